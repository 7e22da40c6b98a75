"""Fixtures the API-only acceptance modules share."""

from __future__ import annotations

import pytest

from tests.support.api import stored_rows
from tests.support.stack import start_service


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def api_only(request, tmp_path_factory):
    """One API-only service per database for the whole module (no writer: nothing gets processed)."""
    tmp = tmp_path_factory.mktemp(f"api-{request.param}")
    url = f"sqlite:///{tmp / 'hsx.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_module_url")
    svc = start_service(tmp, url, extra=["--no-writer"])
    yield svc
    svc.stop()


@pytest.fixture
def unchanged(service):
    """Asserts at the end of the test that no job or sample was stored by it (`service`: the module's)."""
    before = stored_rows(service.database_url)
    yield
    assert stored_rows(service.database_url) == before
