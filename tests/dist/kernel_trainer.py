"""trainer_scenarios.py under Triton's interpreter (TRITON_INTERPRET=1): liger's kernels run on CPU tensors, with
the test-side adaptations of tests/triton_interpreter.py. Run by tests/test_kernels.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/dist/
import triton_interpreter  # noqa: E402, F401  (before anything imports triton)
import trainer_scenarios  # noqa: E402

if __name__ == "__main__":
    trainer_scenarios.main()
