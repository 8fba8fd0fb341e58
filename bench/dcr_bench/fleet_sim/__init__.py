"""A deterministic simulation of the fleet switch (``dcr fleet``): the real coordinator and member
code against a seeded scheduler, with the invariants checked after every event.

- ``scheduler``: one simulated thread runs at a time, picked by ``random.Random(seed)``;
- ``world``: the seams the real code runs through (ROOT, clocks, threads, progress points);
- ``vllm_server``: a member server (vLLM's routes and session around DCR's real backend);
- ``transport``: the network, with delayed, lost and duplicated requests and answers;
- ``schedule``: one schedule (coordinators, members, crashes, restarts, retractions, clock jumps);
- ``invariants``: what must hold after every event;
- ``run``: many schedules, their figures, ``python -m dcr_bench.fleet_sim`` (``make sim-fleet``).

docs/testing.md ("The fleet simulation") says what runs and what it found.
"""
