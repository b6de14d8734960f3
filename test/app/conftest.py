from quant_fixtures import model_dir, practice_file, stub_service  # noqa: F401 - fixtures of the app tests
