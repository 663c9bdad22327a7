import pytest


@pytest.fixture(scope="session")
def tiny_loaded():
    from disagg.engine.models.tiny import build_tiny

    return build_tiny(seed=0)


@pytest.fixture(scope="session")
def smollm2_loaded():
    from disagg.engine_config import ModelConfig
    from disagg.engine.loader import load_model

    return load_model(ModelConfig(model="smollm2-135m"))
