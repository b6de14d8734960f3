import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))

from quant_fixtures import model_dir, practice_file, restore_log_level_env, stub_service  # noqa: E402, F401
