"""Where a target's files are: the embedded name, a local model directory, or a hub id.

A path that is neither must fail at once, in one line: transformers would try the hub, retry for
about a minute where none is reachable, and end in an 80-line traceback. Local paths are checked
first; a hub id loads offline when it is cached (no network at all), and otherwise only after a
3-second check that the hub answers.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path

from dflash_train.disk import require_writable
from dflash_train.errors import UserError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class TargetError(UserError):
    pass


def _set_offline() -> None:
    """HF_HUB_OFFLINE=1 for this process: huggingface_hub read the variable at import, so its
    constant is set too (every check in huggingface_hub reads the constant)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the hub does not answer within `timeout_s`, or None when it does (proxy settings apply)."""
    from huggingface_hub import constants

    try:
        urllib.request.urlopen(constants.ENDPOINT, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as err:
        return f"{constants.ENDPOINT}: {getattr(err, 'reason', err)}"
    return None


def check_target_path(path: str, label: str = "target.path") -> str:
    """`path` if it can be loaded without a long hang, else TargetError naming it."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise TargetError(f"{label} '{path}': {local} has no config.json (not a model directory)")
        return str(local)
    if local.exists():
        raise TargetError(f"{label} '{path}': a file, not a model directory")
    if not HUB_ID.match(path):
        raise TargetError(f"{label} '{path}': no such directory")
    if any(os.environ.get(v) for v in OFFLINE_VARS):
        return path  # the user chose; loading failures are reported in one line by load_pretrained
    if _cached(path):
        _set_offline()  # everything is local: no request, no retries
        return path
    if (why := hub_unreachable()) is not None:
        raise TargetError(f"{label} '{path}': no such directory, and no model hub is reachable ({why})")
    from huggingface_hub import constants

    require_writable(constants.HF_HUB_CACHE, f"the download of {path}")  # before minutes of downloading
    return path


def load_pretrained(loader, path: str, label: str = "target.path", **kwargs):
    """`loader.from_pretrained(path, ...)` with a missing or broken model as one line naming it."""
    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        offline = " (offline: HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set)" if any(
            os.environ.get(v) for v in OFFLINE_VARS) else ""
        raise TargetError(f"{label} '{path}': cannot load {loader.__name__}{offline}: {first}") from None
