import os
import sys
from pathlib import Path

# OpenMP threads that busy-wait collapse numba/torch speed when the other core is busy
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
