"""The stages of the GPU script (``microbench/run_gpu.py``): one module each, with a ``run(ctx)``
that appends every point it measures to the run's JSON-lines file (``points.py``) and returns its
exit status. ``run_stage.py`` runs one stage in its own process."""
