"""What DCR's Prefect flows (``flows.prefect_flows``) are made of: the runner that turns each step
into a task (``runner``), the task cache of a publish's mapped groups (``task_cache``), the runs'
names and tags (``runs``) and the artifacts and events a run leaves (``reports``)."""
