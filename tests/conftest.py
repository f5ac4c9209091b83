"""One OpenMP thread, passive wait, for the tests that compute in the pytest process itself, set before anything
imports torch. CI runs plain `python -m pytest` (nothing sets OMP_NUM_THREADS): torch then takes a thread per
core with busy-waiting workers, and on the 2-core box a tiny MoE forward+backward measured 4.5 s per step against
0.15 s with one thread (dense: 2.8 s vs 0.09 s; a loaded box, so the ratio is rough). The launches the tests
start set their own threads (helpers.child_env; train.sh when the variable is unset, which test_e2e checks)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
