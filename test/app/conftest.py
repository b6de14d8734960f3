from quant_fixtures import model_dir, practice_file, restore_log_level_env, stub_service  # noqa: F401 - fixtures
