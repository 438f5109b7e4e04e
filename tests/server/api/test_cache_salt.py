"""`cache_salt` (vLLM's per-request prefix-cache isolation) through the HTTP server: a tenant with another
salt gets no cached tokens from a prompt someone else sent, the same salt does, and bad salts are a 400."""

from __future__ import annotations

import httpx
import pytest

from engine.sampling import MAX_CACHE_SALT_CHARS

# Long enough for several 16-token blocks; unique to this file, so nothing else has cached it.
TEXT = ("Tenant isolation check: the ledger for account 4471 shows three transfers on Monday, two on "
        "Tuesday and a refund of forty-two euros on Friday afternoon, signed by the branch manager.")


def _cached(c: httpx.Client, endpoint: str, salt: str | None) -> int:
    body: dict = {"max_tokens": 2, "temperature": 0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": TEXT}]
    else:
        body["prompt"] = TEXT
    if salt is not None:
        body["cache_salt"] = salt
    r = c.post("/v1/chat/completions" if endpoint == "chat" else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 2 * 16  # two full blocks at least
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_other_salt_gets_no_cached_tokens_same_salt_does(make_server, endpoint: str) -> None:
    with make_server() as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        assert _cached(c, endpoint, "tenant-a") == 0
        assert _cached(c, endpoint, "tenant-b") == 0  # the same prompt, another tenant: nothing shared
        assert _cached(c, endpoint, None) == 0  # nor with unsalted requests
        assert _cached(c, endpoint, "tenant-a") > 0
        assert _cached(c, endpoint, "tenant-b") > 0
        assert _cached(c, endpoint, None) > 0  # no salt: shared among unsalted requests, as before
        assert srv.idle()


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 123, ["a"], None])
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_bad_salts_are_a_400(server, endpoint: str, salt: object) -> None:
    body: dict = {"max_tokens": 2, "cache_salt": salt}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in endpoint else {"prompt": "hi"}
    r = httpx.post(server.url + endpoint, json=body, timeout=60)
    if salt is None:  # JSON null: the field left unset
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and "cache_salt" in err["message"], err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.idle()
