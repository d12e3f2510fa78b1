"""``flywheel serve``'s public surface attacked one property at a time.

Each test reproduces a defect that an outside review found in the server (it failed before the
fix) and pins the fix. Sections, in order:

1. a served model could be swapped through the adapter endpoint without a gate  (``test_adapter_*``)
2. a hot swap kept every replaced model in memory                                (``test_hot_swap_*``)
3. stop strings were unbounded and rescanned the whole text every step           (``test_stop_strings_*``)
4. loopback is not a trust boundary (CORS-free POSTs, DNS rebinding)             (``test_loopback_*``)
5. robustness: nesting, NaN, error text, key on argv, uvicorn bounds, batches,
   pydantic request models                                                       (``test_robust_*``)

Servers run on free loopback ports (:func:`flywheel.serve.run_in_thread`); models are the tiny
random model, or scripted stubs where only the HTTP layer is under test.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import weakref
from urllib.parse import urlparse

import httpx
import pytest
import torch

from flywheel.policy.base import PromptTooLongError, Sample, SamplingParams
from flywheel.policy.batching import BatchingPolicy
from flywheel.policy.testing import make_lora_adapter, tiny_policy
from flywheel.serve import (
    AdapterLoading,
    ApiError,
    ChatCompletionRequest,
    ServeError,
    ServeLimits,
    allowed_hosts_for,
    create_app,
    host_name,
    parse_request,
    resolve_api_key,
    run_in_thread,
    static_provider,
    store_recorder,
)

CHAT = [{"role": "user", "content": "What's the weather in Paris?"}]
JSON = {"content-type": "application/json"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, with tiny_home


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    """The one directory the adapter tests allow loads from."""
    return tmp_path_factory.mktemp("allowed-adapters")


@pytest.fixture(scope="module")
def good_adapter(tiny_home, adapter_root):
    return make_lora_adapter(tiny_home, adapter_root / "good", seed=5)


@pytest.fixture(scope="module")
def champion(tiny_home, tmp_path_factory):
    """What ``serve --champion`` serves for a LoRA champion: the base plus the adapter ``default``."""
    lora = make_lora_adapter(tiny_home, tmp_path_factory.mktemp("champion") / "lora", seed=1)
    return tiny_policy(tiny_home, adapter=lora, name="policy", version="1")


class Recorder:
    """An in-memory event sink; ``fail_on`` makes appends of those event types raise."""

    def __init__(self, fail_on: tuple[str, ...] = ()) -> None:
        self.events: list[tuple[str, str, dict]] = []
        self.fail_on = fail_on

    def __call__(self, type_: str, stream: str, payload: dict) -> None:
        if type_ in self.fail_on:
            raise OSError("event store unavailable")
        self.events.append((type_, stream, payload))


class Stub:
    """Answers with fixed text; counts calls; optionally blocks each call until ``gate`` is set."""

    def __init__(self, text: str = "ok", gate: threading.Event | None = None, error: Exception | None = None):
        self.name, self.version = "stub", "1"
        self.text, self.gate, self.error = text, gate, error
        self.calls = 0
        self.inside = 0
        self.cond = threading.Condition()

    def generate(self, prompts, params=None, *, tools=None):
        with self.cond:
            self.calls += 1
            self.inside += 1
            self.cond.notify_all()
        try:
            if self.gate is not None:
                assert self.gate.wait(60)
            if self.error is not None:
                raise self.error
            n = params.n if isinstance(params, SamplingParams) else 1
            return [[Sample(self.text, [1], [2], [-0.5], "stop", False, 1.0) for _ in range(n)] for _ in prompts]
        finally:
            with self.cond:
                self.inside -= 1

    def wait_inside(self, k: int, timeout_s: float = 60) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.inside >= k, timeout_s), f"{self.inside} of {k} calls arrived"


def _chat_ids(url: str, model: str | None = None) -> list[int]:
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    if model:
        body["model"] = model
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]


# The adapter endpoints' key (issue 31, finding 12: required even on loopback).
ADMIN_KEY = "adapter-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _load(url: str, name: str, path, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=120,
                      headers=headers)


def _unload(url: str, name: str, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120, headers=headers)


def _lora_layers(policy) -> int:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sum(isinstance(m, BaseTunerLayer) for m in policy.model.modules())


# =========================================================================== 1. adapter swap
def test_adapter_loading_is_off_by_default(tiny_home, good_adapter):
    pol = tiny_policy(tiny_home, name="tiny")
    with run_in_thread(create_app(static_provider("tiny", pol))) as url:
        before = _chat_ids(url)
        for r in (_load(url, "ft", good_adapter), _unload(url, "ft")):
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "adapter_loading_disabled"
        assert _models(url) == ["tiny"]
        assert _chat_ids(url) == before
    assert pol.adapter_names() == set()


def test_adapter_reserved_and_loaded_names_are_never_replaced(champion, good_adapter, adapter_root):
    rec = Recorder()
    app = create_app(static_provider("policy", champion), adapter_loading=AdapterLoading((adapter_root,), rec, api_key=ADMIN_KEY))
    with run_in_thread(app) as url:
        before = _chat_ids(url)
        for name in ("default", "policy"):  # the champion's own adapter, the served model's name
            r = _load(url, name, good_adapter)
            assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_name_reserved", r.text
        assert _chat_ids(url) == before  # the champion still answers with its own weights
        assert _load(url, "ft", good_adapter).status_code == 200
        tuned = _chat_ids(url, "ft")
        r = _load(url, "ft", good_adapter)
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_already_loaded"
        assert _chat_ids(url, "ft") == tuned and _chat_ids(url) == before
        assert _unload(url, "ft").status_code == 200
        assert _models(url) == ["policy"] and _chat_ids(url) == before
    assert [t for t, _, _ in rec.events] == ["adapter.loaded", "adapter.unloaded"]
    assert champion.adapter_names() == {"default"}


def test_adapter_endpoints_need_a_key_even_on_loopback(champion, good_adapter, adapter_root):
    """Finding 12: on loopback the adapter endpoints needed no key, so any local user could load an
    adapter into the served model. Now every load and unload needs the key, whatever the bind address;
    chat on loopback stays open (no server key here)."""
    rec = Recorder()
    with pytest.raises(ServeError, match="API key"):  # no key at all: adapter loading is refused at start
        create_app(static_provider("policy", champion), adapter_loading=AdapterLoading((adapter_root,), rec))
    app = create_app(static_provider("policy", champion), adapter_loading=AdapterLoading((adapter_root,), rec,
                                                                                         api_key=ADMIN_KEY))
    with run_in_thread(app) as url:
        before = _chat_ids(url)  # no key needed to chat
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
            for r in (_load(url, "ft", good_adapter, headers), _unload(url, "ft", headers)):
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert _models(url) == ["policy"] and _chat_ids(url) == before and rec.events == []
        assert _load(url, "ft", good_adapter).status_code == 200
        assert _unload(url, "ft").status_code == 200
    assert [t for t, _, _ in rec.events] == ["adapter.loaded", "adapter.unloaded"]


def test_adapter_names_of_registered_models_and_aliases_are_reserved(champion, good_adapter, adapter_root):
    """Finding 12: only the served name and ``default`` were reserved: a gate-refused challenger could be
    loaded under the name ``champion``. Now the registry's aliases (champion, challenger) and every
    registered model name and alias the server is told of are refused (409), and a registry that cannot
    be read refuses the load rather than guessing."""
    rec = Recorder()
    registry = {"names": {"policy", "policy-b", "judge"}, "aliases": {"champion", "challenger", "staging"}}
    loading = AdapterLoading((adapter_root,), rec, api_key=ADMIN_KEY,
                             reserved=lambda: registry["names"] | registry["aliases"])
    with run_in_thread(create_app(static_provider("policy", champion), adapter_loading=loading)) as url:
        before = _chat_ids(url)
        for name in ("champion", "challenger", "staging", "policy-b", "judge", "default", "policy"):
            r = _load(url, name, good_adapter)
            assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_name_reserved", (name, r.text)
        assert _models(url) == ["policy"] and _chat_ids(url) == before
        registry["names"] = None  # the registry cannot be read: set | None raises
        r = _load(url, "ft", good_adapter)
        assert r.status_code == 503 and r.json()["error"]["code"] == "registry_unavailable", r.text
        registry["names"] = set()
        assert _load(url, "ft", good_adapter).status_code == 200
        assert _unload(url, "ft").status_code == 200  # the champion fixture is shared: leave it as found
    assert [t for t, _, _ in rec.events] == ["adapter.loaded", "adapter.unloaded"]
    assert champion.adapter_names() == {"default"}


def test_adapter_path_must_lie_in_an_allowed_dir_and_errors_never_echo_paths(
    champion, good_adapter, adapter_root, tiny_home, tmp_path
):
    outside = make_lora_adapter(tiny_home, tmp_path / "elsewhere-lora", seed=6)
    link = adapter_root / "link-to-outside"
    link.symlink_to(outside, target_is_directory=True)
    linked_file = adapter_root / "linked-weights"
    linked_file.mkdir()
    shutil.copy(outside / "adapter_config.json", linked_file)
    (linked_file / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    pickled = adapter_root / "pickled"
    pickled.mkdir()
    shutil.copy(outside / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded: pickles can run code")
    traversal = f"{adapter_root}/{os.path.relpath(outside, adapter_root)}"
    cases = [
        (str(outside), 403, "adapter_path_not_allowed"),
        (traversal, 403, "adapter_path_not_allowed"),
        (str(link), 403, "adapter_path_not_allowed"),
        (str(linked_file), 403, "adapter_path_not_allowed"),
        ("/etc", 403, "adapter_path_not_allowed"),
        ("relative/lora", 400, None),
        (f"{adapter_root}/good\x00/../elsewhere-lora", 400, None),
        (str(adapter_root / "missing"), 400, "adapter_not_found"),
        (str(pickled), 400, "adapter_not_found"),
    ]
    rec = Recorder()
    app = create_app(static_provider("policy", champion), adapter_loading=AdapterLoading((adapter_root,), rec, api_key=ADMIN_KEY))
    with run_in_thread(app) as url:
        for path, status, code in cases:
            r = _load(url, "ft", path)
            assert r.status_code == status, (path, r.text)
            assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == "lora_path"
            for secret in {str(tmp_path), str(adapter_root), os.path.realpath(tmp_path), "elsewhere-lora"}:
                assert secret not in r.text, (path, r.text)
        assert _models(url) == ["policy"]
    assert rec.events == [] and champion.adapter_names() == {"default"}


def _broken_adapters(good, root):
    """A truncated weights file (unreadable) and weights of the wrong shape (fail inside peft)."""
    from safetensors.torch import load_file, save_file

    truncated = root / "truncated"
    shutil.copytree(good, truncated, dirs_exist_ok=True)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    misshapen = root / "misshapen"
    shutil.copytree(good, misshapen, dirs_exist_ok=True)
    tensors = load_file(str(good / "adapter_model.safetensors"))
    tensors = {k: torch.zeros(v.shape[0], v.shape[1] + 1) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(tensors, str(misshapen / "adapter_model.safetensors"))
    return truncated, misshapen


def test_adapter_a_failed_load_leaves_the_served_model_as_it_was(champion, tiny_home, good_adapter, adapter_root):
    truncated, misshapen = _broken_adapters(good_adapter, adapter_root)
    plain = tiny_policy(tiny_home, name="tiny")
    for name, base in (("policy", champion), ("tiny", plain)):
        names, layers = base.adapter_names(), _lora_layers(base)
        rec = Recorder()
        app = create_app(static_provider(name, base), adapter_loading=AdapterLoading((adapter_root,), rec, api_key=ADMIN_KEY))
        with run_in_thread(app) as url:
            before = _chat_ids(url)
            for lora_name, path in (("trunc", truncated), ("shape", misshapen)):
                r = _load(url, lora_name, path)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["code"] == "adapter_load_failed"
                assert str(adapter_root) not in r.text
                assert _chat_ids(url) == before, f"{name}: a failed load of {lora_name!r} changed the model"
            assert _models(url) == [name]
            assert _load(url, "ok", good_adapter).status_code == 200  # and loading still works afterwards
            assert _unload(url, "ok").status_code == 200
        assert base.adapter_names() == names and _lora_layers(base) == layers
        assert [t for t, _, _ in rec.events] == ["adapter.loaded", "adapter.unloaded"]


def test_adapter_loads_and_unloads_are_events_in_the_store(cfg, champion, good_adapter, adapter_root):
    from flywheel.store import open_store

    app = create_app(static_provider("policy", champion),
                     adapter_loading=AdapterLoading((adapter_root,), store_recorder(cfg), api_key=ADMIN_KEY))
    with run_in_thread(app) as url:
        for _ in range(2):
            assert _load(url, "ft", good_adapter).status_code == 200
            assert _unload(url, "ft").status_code == 200
    with open_store(cfg) as store:
        events = store.read(stream="serve:policy")
    assert [e.type for e in events] == ["adapter.loaded", "adapter.unloaded"] * 2
    h = hashlib.sha256()
    for fname in ("adapter_config.json", "adapter_model.safetensors"):
        h.update(fname.encode() + b"\0" + (good_adapter / fname).read_bytes())
    first = events[0].payload
    assert first["lora_name"] == "ft" and first["adapter_sha256"] == h.hexdigest()
    assert first["base_model"] == "policy" and first["base_version"] == "1"
    assert first["adapter_path"] == os.path.realpath(good_adapter)
    assert events[1].payload["load_id"] == first["load_id"] != events[2].payload["load_id"]
    assert events[1].payload["reason"] == "api"


def test_adapter_a_load_or_unload_that_cannot_be_recorded_changes_nothing(champion, good_adapter, adapter_root):
    rec = Recorder(fail_on=("adapter.loaded",))
    app = create_app(static_provider("policy", champion), adapter_loading=AdapterLoading((adapter_root,), rec, api_key=ADMIN_KEY))
    with run_in_thread(app) as url:
        r = _load(url, "ft", good_adapter)
        assert r.status_code == 503 and r.json()["error"]["code"] == "event_store_unavailable"
        assert _models(url) == ["policy"] and champion.adapter_names() == {"default"}
        rec.fail_on = ("adapter.unloaded",)
        assert _load(url, "ft", good_adapter).status_code == 200
        tuned = _chat_ids(url, "ft")
        r = _unload(url, "ft")
        assert r.status_code == 503 and r.json()["error"]["code"] == "event_store_unavailable"
        assert _chat_ids(url, "ft") == tuned  # still served, as the history says
        rec.fail_on = ()
        assert _unload(url, "ft").status_code == 200
    assert [t for t, _, _ in rec.events] == ["adapter.loaded", "adapter.unloaded"]
    assert champion.adapter_names() == {"default"}


def test_adapter_of_a_replaced_base_is_forgotten_and_recorded(tiny_home, good_adapter, adapter_root):
    old, new = tiny_policy(tiny_home, name="tiny", version="1"), tiny_policy(tiny_home, name="tiny", version="2")
    current = {"p": ("tiny", old)}
    rec = Recorder()
    app = create_app(lambda: current["p"], adapter_loading=AdapterLoading((adapter_root,), rec, api_key=ADMIN_KEY))
    with run_in_thread(app) as url:
        assert _load(url, "ft", good_adapter).status_code == 200
        current["p"] = ("tiny", new)  # a promotion
        assert _models(url) == ["tiny"]
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "ft", "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 404
    assert [(t, p["reason"]) for t, _, p in rec.events if t == "adapter.unloaded"] == [("adapter.unloaded",
                                                                                         "base_model_changed")]
    assert old.adapter_names() == set() and new.adapter_names() == set()


# =========================================================================== 2. hot swap memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_hot_swap_frees_replaced_models_rss_bounded_over_5_promotions(cfg, tiny_home):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from flywheel.deploy import ChampionWatcher
    from flywheel.policy.hf import HFPolicy
    from flywheel.policy.models import TINY, base_dir

    tok = AutoTokenizer.from_pretrained(str(base_dir(tiny_home) / TINY))

    def build(version: int) -> HFPolicy:
        # hidden size 256: a 49,152 x 256 fp32 embedding, 48 MiB per model, so a leak of one model
        # per promotion stands far above allocator noise
        config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True)
        return HFPolicy(LlamaForCausalLM(config).eval(), tok, device="cpu", name="policy", version=str(version))

    alias = {"v": 1}
    watcher = ChampionWatcher(cfg, loader=build, alias_version=lambda: alias["v"], poll_s=3600)
    watcher.start(install_sighup=False)
    model_bytes = sum(p.numel() * p.element_size() for p in watcher()[1].model.parameters())
    body = {"messages": CHAT, "max_tokens": 2, "temperature": 0}
    replaced: list[weakref.ref] = []
    try:
        with run_in_thread(create_app(watcher)) as url:
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200
            gc.collect()
            start = _rss_bytes()
            for v in range(2, 7):
                replaced.append(weakref.ref(watcher()[1]))
                alias["v"] = v
                assert watcher.check_now()  # the promotion: ChampionWatcher loads v and swaps
                assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200
            gc.collect()
            grown = _rss_bytes() - start
    finally:
        watcher.stop()
    print(f"RSS +{grown / 2**20:.0f} MiB over 5 promotions of a {model_bytes / 2**20:.0f} MiB model "
          f"(load {os.getloadavg()[0]:.1f})")
    assert [r() is None for r in replaced] == [True] * 5, "a replaced model is still referenced"
    # leaking, RSS grew by ~5 models (measured: 242 MiB for 48 MiB models); freed, by about one
    assert grown < 1.5 * model_bytes, (
        f"RSS grew {grown / 2**20:.0f} MiB over 5 promotions of a {model_bytes / 2**20:.0f} MiB model"
    )


# =========================================================================== 3. stop strings
def test_stop_strings_are_capped_in_count_and_length():
    stub = Stub("hello")
    with run_in_thread(create_app(static_provider("stub", stub))) as url:  # default limits: 1 MB, 4 stops, 128 chars
        raw = json.dumps({"messages": CHAT, "stop": ["a"] * 140_000}).encode()
        assert len(raw) < 1_000_000
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers=JSON, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert "at most 4 stop strings" in r.json()["error"]["message"]
        print(f"140k stop strings refused in {time.perf_counter() - t0:.3f} s, load {os.getloadavg()[0]:.1f}")
        for stop in (["a", "b", "c", "d", "e"], ["x" * 129], [""], "", [1]):
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "stop": stop})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop", (stop, r.text)
        for stop in (["x" * 128, "b", "c", "d"], "\n\nUser:", None):
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "stop": stop})
            assert r.status_code == 200, (stop, r.text)
    assert stub.calls == 3


def test_stop_strings_are_matched_on_the_text_tail_only(tiny_home, monkeypatch):
    pol = tiny_policy(tiny_home)
    decoded: list[int] = []
    decode = pol.tokenizer.decode

    def spy(ids, *args, **kwargs):
        decoded.append(len(ids))
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(pol.tokenizer, "decode", spy)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=48, seed=3, stop=["\u2603 never", "zz\u2603"])
    (group,) = pol.generate([CHAT], params)
    assert [s.finish_reason for s in group] == ["length", "length"]  # no stop matched: every step looked
    long = [n for n in decoded if n > 16]
    # one full decode per sample for its text; the per-step checks decode a few tokens each (before
    # the fix every step decoded the whole completion: ~2 x 48 long decodes)
    assert len(long) <= 2, f"{len(long)} decodes of more than 16 tokens: {long}"


# =========================================================================== 4. loopback trust
def test_loopback_posts_without_a_json_content_type_are_refused_before_any_work():
    stub = Stub()
    with run_in_thread(create_app(static_provider("stub", stub))) as url:
        body = json.dumps({"messages": CHAT}).encode()
        # what a web page can send without a CORS preflight: text/plain, forms, or no type at all
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": ctype} if ctype else {})
            assert r.status_code == 415, (ctype, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
        ok = httpx.post(f"{url}/v1/chat/completions", content=body,
                        headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200, ok.text
    assert stub.calls == 1


def test_loopback_foreign_host_headers_are_refused_against_dns_rebinding():
    stub = Stub()
    with run_in_thread(create_app(static_provider("stub", stub))) as url:
        port = urlparse(url).port
        for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.nip.io:{port}", "[::2]:80", "::1",
                     "localhost:http"):
            for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/chat/completions")):
                r = httpx.request(method, f"{url}{path}", json={"messages": CHAT}, headers={"Host": host})
                assert r.status_code == 400, (host, path, r.text)
                assert r.json()["error"]["code"] == "invalid_host"
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LOCALHOST.:{port}", f"[::1]:{port}"):
            assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200, host
    assert stub.calls == 0


def test_loopback_allowed_hosts_follow_the_bind_address():
    assert host_name("[::1]:8000") == "::1" and host_name("Localhost.:80") == "localhost"
    assert host_name("a:b") is None and host_name("::1") is None and host_name("") is None
    assert set(allowed_hosts_for("127.0.0.1")) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts_for("10.0.0.5", ["gpu-box.internal"]) == ("10.0.0.5", "gpu-box.internal")
    assert allowed_hosts_for("0.0.0.0") == ("*",)  # a wildcard bind has a key, which a rebinding page lacks
    assert "gpu-box" in allowed_hosts_for("0.0.0.0", ["gpu-box"]) and "*" not in allowed_hosts_for("::", ["a"])
    assert allowed_hosts_for("127.0.0.1", ["*"]) == ("*",)


# =========================================================================== 5. robustness
def test_robust_deeply_nested_json_is_a_400_not_a_500():
    stub = Stub()
    with run_in_thread(create_app(static_provider("stub", stub))) as url:
        deep = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = httpx.post(f"{url}/v1/chat/completions", content=deep, headers=JSON, timeout=60)
        assert r.status_code == 400, r.text
        assert "not valid JSON" in r.json()["error"]["message"] and "Recursion" not in r.text
    assert stub.calls == 0


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('"temperature": NaN', None),
        ('"top_p": Infinity', None),
        ('"temperature": -Infinity', None),
        ('"temperature": 1e999', "temperature"),
        ('"tools": [{"type": "function", "function": {"name": "f", "parameters": {"minimum": -1e999}}}]', "tools"),
        ('"metadata": {"score": 1e400}', "metadata"),
    ],
)
def test_robust_non_finite_numbers_are_refused(raw, param):
    stub = Stub()
    with run_in_thread(create_app(static_provider("stub", stub))) as url:
        body = ('{"messages": [{"role": "user", "content": "hi"}], ' + raw + "}").encode()
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert stub.calls == 0


def test_robust_error_bodies_carry_no_internal_text(caplog):
    boom = Stub(error=RuntimeError("/srv/secret/weights.safetensors: CUDA error at 0xdeadbeef"))
    with caplog.at_level(logging.ERROR, logger="flywheel.serve"), \
            run_in_thread(create_app(static_provider("stub", boom))) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error"
    for secret in ("secret", "RuntimeError", "0xdeadbeef", "Traceback"):
        assert secret not in r.text
    ref = err["message"].split("reference ")[1].split()[0]
    assert ref in caplog.text and "0xdeadbeef" in caplog.text  # the operator still sees what happened


def test_robust_an_over_long_prompt_is_a_400_that_names_the_limit(tiny_home):
    pol = tiny_policy(tiny_home, name="tiny")
    with run_in_thread(create_app(static_provider("tiny", pol))) as url:
        long = [{"role": "user", "content": "hello " * 5000}]
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": long, "max_tokens": 2}, timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert "context is 4096 tokens" in err["message"]


class _Gated:
    """The first call blocks until released; a prompt whose text is "long" fails the call it is in."""

    name, version = "gated", "1"

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        self.batches: list[list[str]] = []

    def generate(self, prompts, params=None, *, tools=None):
        texts = [p[-1]["content"] for p in prompts]
        self.batches.append(texts)
        if len(self.batches) == 1:
            self.entered.set()
            assert self.release.wait(60)
        if "long" in texts:
            raise PromptTooLongError(texts.index("long"), 5000, 4096)
        return [[Sample(t, [1], [2], [-0.1], "stop", False, 1.0)] for t in texts]


def test_robust_one_over_long_prompt_in_a_merged_batch_fails_only_its_own_request():
    inner = _Gated()
    b = BatchingPolicy(inner, window_s=0.0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    results: dict[str, object] = {}

    def call(text):
        try:
            results[text] = b.generate([[{"role": "user", "content": text}]], greedy)[0][0].text
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            results[text] = e

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert inner.entered.wait(60)  # the first batch is running: the next two callers queue together
    others = [threading.Thread(target=call, args=(t,)) for t in ("long", "short")]
    for t in others:
        t.start()
    deadline = time.monotonic() + 60
    while len(b._pending) < 2:
        assert time.monotonic() < deadline, "the two callers never queued"
        time.sleep(0.005)
    inner.release.set()
    for t in [first, *others]:
        t.join(60)
    assert sorted(inner.batches[1]) == ["long", "short"]  # they were merged into one call
    assert results["first"] == "first" and results["short"] == "short"
    assert isinstance(results["long"], PromptTooLongError)


def test_robust_api_key_comes_from_env_or_file_never_argv(cfg, tmp_path, monkeypatch, caplog):
    import typer
    from typer.testing import CliRunner

    from flywheel.cli import serve as serve_cli

    monkeypatch.delenv(cfg.serve.api_key_env, raising=False)
    app = typer.Typer()
    serve_cli.register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer in multi-command mode
    missing = str(tmp_path / "no-such-model")
    argv = ["serve", "--host", "0.0.0.0", "--model", missing, "--home", str(tmp_path / "h")]
    result = CliRunner().invoke(app, [*argv, "--api-key", "s3cret"])
    assert result.exit_code == 2 and "No such option" in result.output  # ps would show it to every user

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    key_file.chmod(0o600)
    result = CliRunner().invoke(app, [*argv, "--api-key-file", str(key_file)])
    assert result.exit_code == 2 and "no-such-model" in result.output  # past the key check, at the model
    assert "requires an API key" not in result.output

    assert resolve_api_key(cfg, None, "0.0.0.0", key_file=key_file) == "from-file"
    monkeypatch.setenv(cfg.serve.api_key_env, "from-env")
    assert resolve_api_key(cfg, None, "0.0.0.0") == "from-env"
    assert resolve_api_key(cfg, None, "0.0.0.0", key_file=key_file) == "from-file"  # the flag wins
    monkeypatch.delenv(cfg.serve.api_key_env)
    cfg.serve.api_key_file = key_file
    assert resolve_api_key(cfg, None, "0.0.0.0") == "from-file"
    key_file.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="flywheel.serve"):
        assert resolve_api_key(cfg, None, "0.0.0.0") == "from-file"
    assert "readable by other users" in caplog.text
    key_file.write_text("\n")
    with pytest.raises(ServeError, match="is empty"):
        resolve_api_key(cfg, None, "0.0.0.0")


def _raw_exchange(url: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (30 s at most)."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):  # socket.timeout here means the server never closed it
            got += chunk
        return got


def test_robust_a_request_head_that_never_ends_is_closed():
    app = create_app(static_provider("stub", Stub()), limits=ServeLimits(header_timeout_s=0.5))
    with run_in_thread(app) as url:
        assert _raw_exchange(url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n") == b""
        assert _raw_exchange(url, b"") == b""  # a connection that sends nothing at all
        # after a response, a trickled next head on the same connection has the same deadline: its
        # bytes cancel uvicorn's keep-alive timer, so only the head deadline can close the connection
        # (without it, recv waits out the socket's 30 s timeout and raises)
        u = urlparse(url)
        with socket.create_connection((u.hostname, u.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got or not got.endswith(b"}"):
                got += s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /health HTTP/1.1\r\n")
            assert s.recv(1024) == b""


def test_robust_a_body_that_never_completes_gets_408():
    stub = Stub()
    app = create_app(static_provider("stub", stub), limits=ServeLimits(body_timeout_s=0.5))
    with run_in_thread(app) as url:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")
        got = _raw_exchange(url, head + b'{"messages"')
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"request_timeout" in got and b"connection: close" in got.lower()  # the rest is never read
    assert stub.calls == 0


def test_robust_uvicorn_limit_concurrency_answers_503_beyond_it():
    gate = threading.Event()
    stub = Stub(gate=gate)
    app = create_app(static_provider("stub", stub), limits=ServeLimits(max_concurrency=8, limit_concurrency=3))
    with run_in_thread(app) as url:
        results: list[int] = []

        def one(seed: int) -> None:  # seeded: never merged, so each request is its own generate call
            body = {"messages": CHAT, "seed": seed, "temperature": 1.0}
            results.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        stub.wait_inside(2)
        busy = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT}, timeout=60)
        assert busy.status_code == 503, busy.text  # uvicorn's own refusal: 2 connections + this one = 3
        gate.set()
        for t in threads:
            t.join(60)
        assert results == [200, 200]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": CHAT, "tools": [{"name": "bare_bfcl_doc"}]}, "tools"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": {"a": 1}}}]}, *CHAT]}, "messages"),
        ({"messages": CHAT, "seed": 2**70}, "seed"),
        ({"messages": CHAT, "n": 2.0}, "n"),
        ({"messages": CHAT, "n": True}, "n"),
        ({"messages": CHAT, "logprobs": 1}, "logprobs"),
        ({"messages": CHAT, "temperature": "0.5"}, "temperature"),
        ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": CHAT, "tool_choice": 5}, "tool_choice"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_robust_requests_are_validated_by_pydantic_models_of_the_openai_request(body, param):
    with pytest.raises(ApiError) as e:
        parse_request(ChatCompletionRequest, json.dumps(body).encode(), ServeLimits())
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_robust_a_full_openai_request_parses_into_sampling_params():
    body = {
        "model": "policy", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "n": 2, "temperature": 0.5, "top_p": 0.9, "max_completion_tokens": 7, "seed": 3,
        "stop": "\n", "logprobs": True, "user": "ignored", "presence_penalty": 0,
    }
    req = parse_request(ChatCompletionRequest, json.dumps(body).encode(), ServeLimits())
    assert req.sampling_params(ServeLimits()) == SamplingParams(
        n=2, temperature=0.5, top_p=0.9, max_new_tokens=7, seed=3, stop=["\n"])
    assert req.messages[3].role == "tool" and req.tools[0].function.name == "get_weather"
