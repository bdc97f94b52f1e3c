"""The tuner's core, shared by its training and inference halves: the command lines' flag table (``flags``), the
measuring launches and their failure reasons (``launch``), the empirical session's budget, device and ranking rules
(``session``), the calibration fit (``calibration``) and the empirical report's scaffolding (``report``).  Standard
library only; nothing here imports either half."""
