"""Attacks on the serving features that found a defect, each kept as a regression test.

Fast: no server is started; the keys file is parsed as ``hybridkv serve --api-keys-file`` and
``hybridkv router --api-keys-file`` parse it.
"""

from __future__ import annotations

import pytest

from hybridkv.serve.auth import keyring_from_options, read_keys_file

ADMIN = "sk-admin-0004"


@pytest.mark.parametrize("name,text", [
    ("bound-then-null.json", '{"sk-key-0001": "y", "sk-key-0001": null}'),
    ("two-tenants.json", '{"sk-key-0001": "x", "sk-key-0001": "y"}'),
    ("two-tenants.yaml", "sk-key-0001: x\nsk-key-0001: y\n"),
    ("list.yaml", "- sk-key-0001\n- sk-key-0001\n"),
])
def test_a_key_given_twice_in_the_keys_file_is_refused(tmp_path, name, text):
    """A parser keeps a repeated key's last value silently: a key bound to tenant y and then to
    null would become a key that may name any tenant. The file is refused, naming both entries."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_keys_file(str(path))
    msg = str(err.value)
    assert msg == f"--api-keys-file {path}: entry 2 gives the same key as entry 1; give each key once"
    assert "sk-key" not in msg                                   # never the key itself
    with pytest.raises(ValueError):
        keyring_from_options(None, str(path), ADMIN, environ={})


@pytest.mark.parametrize("name,text", [("nested.json", '[["sk-key-0001"]]'), ("listkey.yaml", "? [a]\n: x\n")])
def test_an_unhashable_key_is_named_not_a_type_error(tmp_path, name, text):
    """A list of lists (or a YAML key that is a list) raised ``TypeError: unhashable type``, a
    traceback at start; it is a one-line error naming the entry."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=r"entry 1: a key must be a non-empty string$"):
        read_keys_file(str(path))


def test_distinct_keys_still_load(tmp_path):
    """The refusals above leave a well-formed file's keys and tenants as they were."""
    (tmp_path / "k.json").write_text('{"sk-x-0001": "x", "sk-y-0002": "y", "sk-any-0003": null}')
    (tmp_path / "k.yaml").write_text("sk-x-0001: x\nsk-y-0002: y\nsk-any-0003:\n")
    (tmp_path / "l.yaml").write_text("- sk-x-0001\n- sk-y-0002\n")
    want = {"sk-x-0001": "x", "sk-y-0002": "y", "sk-any-0003": None}
    assert read_keys_file(str(tmp_path / "k.json")) == want
    assert read_keys_file(str(tmp_path / "k.yaml")) == want
    assert read_keys_file(str(tmp_path / "l.yaml")) == {"sk-x-0001": None, "sk-y-0002": None}
    ring = keyring_from_options(None, str(tmp_path / "k.json"), ADMIN, environ={})
    assert ring.bound == 2 and not ring.api_open


def test_a_router_with_a_wrong_worker_key_says_why_its_workers_stay_out(caplog):
    """`hybridkv router --worker-key` with a key the worker refuses: the worker never entered
    rotation and the router logged nothing (it answered 503 'retry shortly' for ever; the 401
    showed only in /router/stats). It now logs one warning naming the worker and the fix, never
    the key."""
    import argparse
    import logging
    import time

    import httpx

    from hybridkv.serve.auth import KeyRing
    from hybridkv.serve.commands import router_service
    from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
    from hybridkv.serve.router import create_router_app

    caplog.set_level(logging.WARNING, logger="hybridkv.serve.router")
    with RunningServer(ServeOptions(port=0, threads=1, auth=KeyRing({"sk-wapi-0008": None},
                                                                    ("sk-wadmin-0009",)))) as w:
        args = argparse.Namespace(worker=[w.url], policy="hybrid", model="tiny", cost_model=None,
                                  poll_interval=0.05, health_every=2, follow_wait=2.0, store_gbps=1.1,
                                  store_latency_us=194.0, api_key=None, api_keys_file=None,
                                  admin_key=None, worker_key="sk-wrong-0001")
        router = BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")
        try:
            for _ in range(400):
                said = [r.getMessage() for r in caplog.records if "not in rotation" in r.getMessage()]
                if said:
                    break
                time.sleep(0.025)
            assert said == [f"worker {w.url} not in rotation: ValueError: its /v1/cache/info answered 401: the "
                            "router needs the worker's admin key (--worker-key or $HYBRIDKV_WORKER_KEY)"]
            time.sleep(0.3)                                      # a few more polls: said once, not every poll
            assert sum("not in rotation" in r.getMessage() for r in caplog.records) == 1
            assert not any("sk-" in r.getMessage() for r in caplog.records)
            assert httpx.get(f"{router.url}/health", timeout=10).json()["workers_in_rotation"] == 0
        finally:
            router.close()


def test_the_router_does_not_claim_an_open_metrics_route_it_lacks():
    """`hybridkv router` serves no /metrics (GET /metrics is a 404), yet its --admin-key help and
    its start line said '/health and /metrics' never need a key."""
    import argparse

    from hybridkv.serve.auth import KeyRing, add_auth_arguments

    def admin_help(router: bool) -> str:
        parser = argparse.ArgumentParser()
        add_auth_arguments(parser, router=router)
        return next(a.help for a in parser._actions if "--admin-key" in a.option_strings)

    assert "/metrics" not in admin_help(router=True) and "/health never needs a key" in admin_help(router=True)
    assert "/health never needs a key; /metrics needs one once API keys are given" in admin_help(router=False)
    ring = KeyRing({"sk-key-0001": "x"}, (ADMIN,))
    assert ring.describe("read /router/stats", "/health is").endswith("; /health is open")
    assert ring.describe().endswith("; /metrics takes the admin key or a key bound to no tenant; /health is open")
    assert KeyRing().describe().endswith("; /health and /metrics are open")
    assert "no --admin-key was given (a key bound to a tenant may still invalidate that tenant's entries)" in \
        KeyRing({"sk-key-0001": "x"}).describe()
    assert KeyRing({"sk-key-0001": None}).describe().count("invalidate") == 0
