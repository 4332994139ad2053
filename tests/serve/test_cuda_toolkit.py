import pytest

from dflash_train.serve.cuda_toolkit import CudaToolkitError, cublas_flags


def _nvcc(root, release="13.0"):
    nvcc = root / "toolkit" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
    nvcc.chmod(0o755)
    return nvcc


def _touch(*paths):
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")


def test_a_whole_toolkit_needs_no_flags(tmp_path):
    nvcc = _nvcc(tmp_path)
    _touch(tmp_path / "toolkit/include/cublas_v2.h", tmp_path / "toolkit/lib64/libcublas.so")
    assert cublas_flags(nvcc, roots=[]) == []


@pytest.mark.parametrize("release,folder", [("13.0", "cu13"), ("12.8", "cublas")])
def test_the_wheel_of_nvcc_s_major_version_gives_cublas(tmp_path, release, folder):
    nvcc = _nvcc(tmp_path, release)
    major = release.split(".")[0]
    other = tmp_path / "site-a" / "nvidia"  # another major's wheel is passed over
    _touch(other / "cu99/include/cublas_v2.h", other / "cu99/lib/libcublas.so.99", other / "cu99/lib/libcublasLt.so.99")
    here = tmp_path / "site-b" / "nvidia" / folder
    _touch(here / "include/cublas_v2.h", here / f"lib/libcublas.so.{major}", here / f"lib/libcublasLt.so.{major}")
    flags = cublas_flags(nvcc, roots=[other, here.parent])
    assert flags == [f"-DCUDA_cublas_LIBRARY={here}/lib/libcublas.so.{major}",
                     f"-DCUDA_cublasLt_LIBRARY={here}/lib/libcublasLt.so.{major}",
                     f"-DCMAKE_CUDA_FLAGS=-I{here}/include", f"-DCMAKE_CXX_FLAGS=-I{here}/include"]


def test_no_cublas_anywhere_says_what_to_install(tmp_path):
    nvcc = _nvcc(tmp_path)
    with pytest.raises(CudaToolkitError, match=r"no nvidia-cublas wheel for CUDA 13 \(pip install 'nvidia-cublas==13\.\*'\)"):
        cublas_flags(nvcc, roots=[tmp_path])


def test_no_nvcc_is_one_line(tmp_path):
    with pytest.raises(CudaToolkitError, match="needs nvcc on PATH"):
        cublas_flags(tmp_path / "nvcc", roots=[])
