"""The backend's error hierarchy (`art_backend/errors.py`): each error is answered as its class says,
through the one handler, and the table in the module's docstring is the classes' own."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import httpx

from art_backend import errors
from art_backend.errors import ServiceError
from art_backend.server import create_app
from tests.conftest import ServerThread


def _service_errors() -> list[type[ServiceError]]:
    return [cls for _, cls in inspect.getmembers(errors, inspect.isclass) if issubclass(cls, ServiceError)]


def test_the_docstring_table_is_the_classes_own() -> None:
    # a reader takes the statuses from the table: it must not drift from the classes
    rows = re.findall(r"^\s*(?:[├└│─ ]*)(\w+)\s+(\d{3})\s+(\w+)\s+(\S+)", errors.__doc__ or "", re.MULTILINE)
    table = {name: (int(status), type_, None if param == "-" else param) for name, status, type_, param in rows}
    assert table == {cls.__name__: (cls.status_code, cls.error_type, cls.param) for cls in _service_errors()}


class TeapotError(ServiceError):
    """A kind of refusal the server has never heard of: answered without a handler of its own."""

    status_code = 418
    error_type = "TeapotError"
    param = "kettle"


def _refusing(cls: type[ServiceError]) -> Callable[[], None]:
    def refuse() -> None:
        raise cls(f"no {cls.__name__} today")
    return refuse


def test_every_service_error_is_answered_as_its_class_says(tiny_engine: Any) -> None:
    app = create_app(tiny_engine)
    kinds = [*_service_errors(), TeapotError]
    for cls in kinds:
        app.add_api_route(f"/refuse/{cls.__name__}", _refusing(cls), methods=["GET"])
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
        for cls in kinds:
            response = http.get(f"/refuse/{cls.__name__}")
            assert response.status_code == cls.status_code, cls
            assert response.json() == {"error": {"message": f"no {cls.__name__} today", "type": cls.error_type,
                                                 "param": cls.param, "code": cls.status_code}}
