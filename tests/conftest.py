import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# tinygrad's CPU device compiles kernels with clang; where there is none, its
# pure-Python device runs the derived-gradient tests (and docs) instead.
if shutil.which(os.environ.get("CC", "clang")) is None:
    os.environ.setdefault("DEV", "PYTHON")
