import sys
from pathlib import Path

# the model builders are shared with test/quarot
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quarot"))
