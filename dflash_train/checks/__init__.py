"""Run checks: a run that starts fast and never silently slows.

Order of use in a training run (the CLI and trainer wire these; nothing here imports them):
  doctor.run_doctor        before anything: environment, code and cache problems, as a report
  compile_cache.activate   before the first torch.compile; mark_warm once warm-up completes
  compile_settings.compile_settings_kept
                           around a library's set-up (torchao's FP8 conversions): no compile setting
                           of the whole process changed by it
  manifest.build_manifest  at start, written to <run_dir>/manifest.json
  guard.ThroughputGuard    every logged step, compared with the best comparable earlier run
  diff_runs.diff_runs      afterwards: what changed between two runs
"""
