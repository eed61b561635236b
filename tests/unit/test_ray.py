"""runtime/_ray.py without a Ray cluster: the RayWorker declaration's checks, the error
without Ray installed, how Ray's errors are condensed, the unplaceable-actor reason.
(The Ray cluster tests are tests/process/test_ray.py.)"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from ringwire.runtime import _ray

from ringwire import runtime


def test_a_ray_worker_declaration_is_checked() -> None:
    w = runtime.RayWorker("r", "m:f", ray_options={"num_gpus": 1})
    assert w.policy == "stop" and w.transport == "auto"
    with pytest.raises(ValueError, match="Ray's own restarts stay off"):
        runtime.RayWorker("x", "m:f", ray_options={"max_restarts": 3})
    with pytest.raises(ValueError, match="max_task_retries"):
        runtime.RayWorker("x", "m:f", ray_options={"max_task_retries": -1})
    for bad, says in [
        (dict(transport="shm"), "transport must be"),
        (dict(policy="restart"), "policy must be"),
        (dict(ray_options=[1]), "ray_options must be a mapping"),
        (dict(ready="later"), "ready must be"),
    ]:
        with pytest.raises(ValueError, match=says):
            runtime.RayWorker("x", "m:f", **bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # everything after the entry is a keyword
        runtime.RayWorker("x", "m:f", {"num_gpus": 1})  # type: ignore[misc]
    with pytest.raises(ValueError, match="entry must look like"):
        runtime.RayWorker("x", "no-colon")
    with pytest.raises(ValueError, match="worker names"):
        runtime.RayWorker("bad name", "m:f")


def test_without_ray_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of it fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'ringwire\[ray\]'"):
        _ray.import_ray()


def test_a_topology_of_ray_workers_needs_asyncio() -> None:
    import anyio

    pytest.importorskip("trio")
    topo = runtime.Topology([runtime.RayWorker("r", "m:f")])

    async def main() -> None:
        async with topo:
            pass

    with pytest.raises(RuntimeError, match="asyncio backend"):
        anyio.run(main, backend="trio")


def test_boot_id_names_this_kernel() -> None:
    assert len(_ray.boot_id()) == 36 and _ray.boot_id() == _ray.boot_id()


def test_rays_errors_are_condensed_to_their_gist() -> None:
    class RayTaskError(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__("\x1b[36mray::RayHost.run()\x1b[39m (pid=1)\n  File ...\n  ^^^")
            self.cause = cause

    text = _ray._condense(RayTaskError(AttributeError("module 'm' has no attribute 'f'")))
    assert text == "AttributeError: module 'm' has no attribute 'f'"

    class ActorDiedError(Exception):
        pass

    died = ActorDiedError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RayHost\n"
        "\tactor_id: 0f\n The actor is dead because its worker process has died."
    )
    assert _ray._condense(died) == (
        "ActorDiedError: The actor died unexpectedly before finishing this task. "
        "The actor is dead because its worker process has died."
    )


def test_an_unplaceable_actor_is_named() -> None:
    class FakeRay:
        @staticmethod
        def nodes() -> list[dict[str, Any]]:
            return [
                {"Alive": True, "Resources": {"CPU": 2.0, "node_a": 1.0}},
                {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0}},
            ]

    assert _ray._unplaceable(FakeRay, {"num_cpus": 1, "resources": {"node_a": 1}}) == ""
    why = _ray._unplaceable(FakeRay, {"num_gpus": 1})
    assert why.startswith("no live node of the cluster has {'GPU': 1.0}"), why
