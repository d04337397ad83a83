"""Workloads the simulator replays: the types (`types`), the trace readers (`weka`, `mooncake`,
`synthetic`, `mooncake_like`), loading by format name (`load`), and what is done to a loaded
workload before a replay (`turns`, `scale`, `time_scale`, `conversations`)."""
