"""ModelResidency without models: which model loads, waits, stays and goes, on a fake clock.

Fakes stand for catalog entries and loaded models (a name, a fingerprint and
a size are all the rules read); jobs are real GenerateJobs whose replies are
recorded.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefixd.daemon.engine.jobs import DONE, FAILED, GenerateJob
from prefixd.daemon.engine.model_residency import ModelResidency
from prefixd.protocol.errors import ErrorCode
from prefixd.protocol.methods import GenerateParams, PromptInput

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(name: str, size_mb: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, weight_bytes=size_mb * MB, fingerprint=f"fp-{name}", path=f"/models/{name}")


def make_residency(max_mb: int = 0, keep_alive: float = -1.0, fail: tuple[str, ...] = ()):
    catalog = {e.name: e for e in (entry("a", 10), entry("b", 12), entry("c", 30), entry("d", 12))}
    loads, unloads = [], []

    def load(e):
        loads.append(e.name)
        if e.name in fail:
            raise FileNotFoundError(f"{e.path}/model.safetensors")
        return SimpleNamespace(name=e.name, weight_bytes=e.weight_bytes, fingerprint=e.fingerprint)

    clock = Clock()
    residency = ModelResidency(catalog, load, lambda loaded: unloads.append(loaded.name), keep_alive, max_mb * MB, clock)
    return residency, clock, loads, unloads


def job(model: str, keep_alive: float | None = None) -> tuple[GenerateJob, list]:
    replies: list = []
    params = GenerateParams(prompt=PromptInput(text="hi"), model=model, keep_alive=keep_alive)
    return GenerateJob("client", 1, params, emit=lambda kind, payload: replies.append((kind, payload))), replies


def submit(residency: ModelResidency, model: str, keep_alive: float | None = None) -> GenerateJob:
    j, _ = job(model, keep_alive)
    residency.pin(j, model)
    return j


def test_a_model_loads_on_first_use_and_the_lru_idle_one_makes_room():
    residency, _, loads, unloads = make_residency(max_mb=24)
    for name in ("a", "b"):  # 10 + 12 fit in 24
        j = submit(residency, name)
        assert residency.make_resident(j, name)
        j.emit(DONE, {})
    assert loads == ["a", "b"] and residency.resident_bytes == 22 * MB
    a_again = submit(residency, "a")
    assert residency.make_resident(a_again, "a")  # loaded: used again, now the most recent
    a_again.emit(DONE, {})
    c, replies = job("c")
    residency.pin(c, "c")
    assert not residency.make_resident(c, "c")  # 30 MB can never fit in 24: refused, nothing unloaded for it
    assert replies[0][0] == FAILED and "--max-model-memory" in replies[0][1].message and unloads == []
    d = submit(residency, "d")
    assert residency.make_resident(d, "d")  # 12 more: b, the least recently used (though loaded last), goes
    assert unloads == ["b"] and residency.resident_bytes == 22 * MB


def test_a_pinned_model_is_never_unloaded_and_a_parked_job_goes_once_it_is_free():
    residency, _, loads, unloads = make_residency(max_mb=20)
    a = submit(residency, "a")
    assert residency.make_resident(a, "a")
    b = submit(residency, "b")
    assert not residency.make_resident(b, "b")  # a (10) serves: b (12) waits beside it
    assert residency.num_parked == 1 and residency.next_parked() is None and unloads == []
    a.emit(DONE, {})
    assert residency.next_parked() is b
    assert residency.make_resident(b, "b")
    assert unloads == ["a"] and loads == ["a", "b"]


def test_keep_alive_unloads_an_idle_model_and_a_request_without_one_takes_the_default():
    residency, clock, _, unloads = make_residency(keep_alive=-1.0)
    j = submit(residency, "a", keep_alive=10.0)
    residency.make_resident(j, "a")
    clock.now += 60
    residency.unload_expired()
    assert unloads == []  # pinned: its 10 s count from the end of its last request
    j.emit(DONE, {})
    assert residency.describe("a")["keep_alive"] == "10s"
    clock.now += 9.9
    residency.unload_expired()
    assert unloads == []
    clock.now += 0.2
    residency.unload_expired()
    assert unloads == ["a"] and not residency.describe("a")["loaded"]
    j = submit(residency, "a")  # no keep_alive: the daemon's default, for good
    residency.make_resident(j, "a")
    j.emit(DONE, {})
    clock.now += 1e6
    residency.unload_expired()
    assert unloads == ["a"] and residency.describe("a")["keep_alive"] == "forever"


def test_keep_alive_zero_unloads_as_soon_as_the_last_job_ends():
    residency, _, _, unloads = make_residency()
    first, second = submit(residency, "a", keep_alive=0.0), submit(residency, "a")
    residency.make_resident(first, "a")
    first.emit(DONE, {})
    residency.unload_expired()
    assert unloads == []  # the second job still pins it
    second.emit(FAILED, RuntimeError("cancelled"))
    assert residency.describe("a")["keep_alive"] == "forever"  # the last request's keep_alive rules
    assert residency.unload("a") and unloads == ["a"]  # Ollama's load request with keep_alive 0


def test_a_failed_load_fails_that_job_only_and_unpins_it():
    residency, _, loads, _ = make_residency(fail=("b",))
    j, replies = job("b")
    residency.pin(j, "b")
    assert not residency.make_resident(j, "b")
    ((kind, err),) = replies
    assert kind == FAILED and err.code == ErrorCode.MODEL_LOAD_FAILED and "model.safetensors" in err.message
    assert residency.describe("b")["active_jobs"] == 0 and not residency.describe("b")["loaded"]
    again = submit(residency, "b")
    assert not residency.make_resident(again, "b") and loads == ["b", "b"]  # the next request tries again


def test_unpin_is_idempotent_and_only_replies_unpin():
    residency, _, _, _ = make_residency()
    j, replies = job("a")
    unpin = residency.pin(j, "a")
    j.emit("chunk", {"text": "x"})
    assert residency.describe("a")["active_jobs"] == 1
    unpin()
    unpin()
    j.emit(DONE, {})
    assert residency.describe("a")["active_jobs"] == 0 and len(replies) == 2


@pytest.mark.parametrize("max_mb", [0, 100])
def test_without_pressure_nothing_unloads_for_room(max_mb):
    residency, _, _, unloads = make_residency(max_mb=max_mb)
    for name in ("a", "b", "c", "d"):
        j = submit(residency, name)
        assert residency.make_resident(j, name)
        j.emit(DONE, {})
    assert unloads == [] and residency.resident_bytes == 64 * MB


def test_a_load_in_steps_parks_its_jobs_until_the_last_step_and_a_failed_step_fails_them():
    catalog = {e.name: e for e in (entry("a", 10), entry("b", 12))}
    steps_run: list[str] = []

    def load_steps(e):
        for number in range(3):
            steps_run.append(f"{e.name}{number}")
            if e.name == "b" and number == 1:
                raise OSError("the disk went away")
            yield
        return SimpleNamespace(name=e.name, weight_bytes=e.weight_bytes, fingerprint=e.fingerprint)

    residency = ModelResidency(catalog, load=None, on_unload=lambda loaded: None, keep_alive=-1.0,
                               clock=Clock(), load_steps=load_steps)
    a, b = submit(residency, "a"), submit(residency, "a")
    assert not residency.make_resident(a, "a") and not residency.make_resident(b, "a")  # one load for both
    assert steps_run == ["a0"] and residency.describe("a")["loading"] and residency.next_parked() is None
    assert residency.step_loading() and residency.step_loading() and residency.next_parked() is None
    assert not residency.step_loading()  # past the last step: loaded
    assert residency.next_parked() is a and residency.next_parked() is b
    assert residency.make_resident(a, "a") and steps_run == ["a0", "a1", "a2"]

    failing, replies = job("b")
    residency.pin(failing, "b")
    assert not residency.make_resident(failing, "b")
    assert not residency.step_loading()  # the step that fails ends the load ...
    ((kind, err),) = replies  # ... and answers the job that waited for it
    assert kind == FAILED and err.code == ErrorCode.MODEL_LOAD_FAILED and "the disk went away" in err.message
    assert residency.num_parked == 0 and not residency.describe("b")["loaded"]
