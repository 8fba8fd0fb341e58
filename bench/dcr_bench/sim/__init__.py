"""``dcr simulate``'s parts: scenario files (``scenario``), the timeline model (``model``), CPU
calibration (``calibrate``), real measurements (``measure``), validation against measured refits
(``validate``), and the table, JSON and plot (``output``). The command: ``dcr_bench.simulate``."""
