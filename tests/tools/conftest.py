"""The tools' tests run against the server's test bundle and apps: the fixtures of
tests/serving/conftest.py, shared here (the tools sit above the server)."""
from tests.serving.conftest import (  # noqa: F401  (fixtures, found by pytest by name)
    app_factory, bundle, bundle_path, client, client_factory, inputs, live_server, offline,
    pytest_collection_modifyitems,
)
