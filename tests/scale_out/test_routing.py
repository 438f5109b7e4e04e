"""Prefix keys and the replica prefix table (server/routing.py), and merging replicas' expositions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from server.metrics import merge_expositions
from server.routing import CHARS_PER_LINK, MAX_LINKS, PrefixTable, route_key

CHAT = "/v1/chat/completions"


def _chat(*contents: str, **extra: object) -> dict:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)], **extra}


def test_a_follow_up_turn_extends_its_first_turns_chain() -> None:
    first = route_key(CHAT, _chat("Be terse.", "Name a colour."))
    follow = route_key(CHAT, _chat("Be terse.", "Name a colour.", "Blue.", "Why?"))
    assert len(first) == 2 and follow[:2] == first and len(follow) == 4
    assert [c for _, c in follow] == sorted(c for _, c in follow)  # coverage only grows


def test_chains_part_where_the_conversations_part() -> None:
    a = route_key(CHAT, _chat("Be terse.", "Name a colour."))
    b = route_key(CHAT, _chat("Be terse.", "Name a fruit."))
    other_system = route_key(CHAT, _chat("Be verbose.", "Name a colour."))
    assert a[0] == b[0] and a[1] != b[1]  # a shared system prompt shares the first link
    assert other_system[0] != a[0]
    # What renders before the messages is in the root: other tools, another chain.
    with_tools = route_key(CHAT, _chat("Be terse.", "Name a colour.", tools=[{"type": "function"}]))
    assert with_tools[0] != a[0]
    m1, m2 = (route_key(CHAT, _chat("Be terse.", model=m)) for m in ("m1", "m2"))
    assert m1[0] != m2[0]


def test_completion_prompts_are_keyed_in_chunks() -> None:
    text = "x" * (3 * CHARS_PER_LINK + 5)
    chain = route_key("/v1/completions", {"prompt": text})
    longer = route_key("/v1/completions", {"prompt": text + "more"})
    assert len(chain) == 4 and longer[:3] == chain[:3] and longer[3] != chain[3]
    assert chain[-1][1] == len(text)
    tokens = route_key("/v1/completions", {"prompt": list(range(40))})
    assert [c for _, c in tokens] == [16, 32, 40]
    assert route_key("/v1/completions", {"prompt": [text, "other"]}) == chain  # a batch: its first prompt
    assert len(route_key("/v1/completions", {"prompt": "y" * CHARS_PER_LINK * (MAX_LINKS + 3)})) == MAX_LINKS


def test_nothing_to_key_on_gives_an_empty_chain() -> None:
    for path, body in [("/v1/models", {}), (CHAT, {"messages": "nope"}), (CHAT, []),
                       ("/v1/completions", {"prompt": 3}), ("/v1/completions", {"prompt": [1.5]})]:
        assert route_key(path, body) == []


def test_the_table_finds_the_replica_with_the_longest_prefix() -> None:
    table = PrefixTable()
    short = route_key(CHAT, _chat("Be terse.", "Name a colour."))
    long = route_key(CHAT, _chat("Be terse.", "Name a colour.", "Blue.", "Why?"))
    table.insert("r1", short)
    table.insert("r2", long)
    query = route_key(CHAT, _chat("Be terse.", "Name a colour.", "Blue.", "Why?", "Because.", "Sure?"))
    assert table.best(["r1", "r2"], query) == ("r2", long[-1][1])
    assert table.best(["r1"], query) == ("r1", short[-1][1])
    assert table.best(["r1", "r2"], route_key(CHAT, _chat("Other."))) == (None, 0)
    table.keep_only(["r1"])  # r2 is gone: its record with it
    assert table.best(["r1", "r2"], query)[0] == "r1"
    table.drop("r1")
    assert table.best(["r1"], query) == (None, 0)


def test_the_table_forgets_the_oldest_links_first() -> None:
    table = PrefixTable(capacity=4)
    old = route_key(CHAT, _chat("Old.", "a"))
    table.insert("r", old)
    table.insert("r", route_key(CHAT, _chat("Mid.", "b", "c")))
    assert table.match("r", old) > 0  # 5 links > 4: only the old chain's first link went
    table.insert("r", route_key(CHAT, _chat("New.", "d")))
    assert table.match("r", old) == 0
    assert table.match("r", route_key(CHAT, _chat("New.", "d"))) > 0


def test_merged_expositions_label_each_replica_and_keep_one_family_each() -> None:
    def expo(value: float) -> bytes:
        return (b"# HELP vllm:gen_total tokens\n# TYPE vllm:gen_total counter\n"
                b'vllm:gen_total{model_name="m"} ' + str(value).encode() + b"\n"
                b"# HELP vllm:running running\n# TYPE vllm:running gauge\nvllm:running 1.0\n")

    text = merge_expositions({"a": expo(3.0), "b": expo(5.0)}).decode()
    assert text.count("# TYPE vllm:gen_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.labels["replica"], s.name): s.value for f in families.values() for s in f.samples}
    assert samples[("a", "vllm:gen_total")] == 3.0 and samples[("b", "vllm:gen_total")] == 5.0
    assert samples[("a", "vllm:running")] == 1.0 and samples[("b", "vllm:running")] == 1.0
    assert merge_expositions({}) == b""


def test_the_shipped_serve_config_builds_the_replicas_application() -> None:
    import pytest
    import yaml

    pytest.importorskip("ray.serve", reason="the `ray` extra (Ray Serve) is not installed")
    from ray.serve.schema import ServeDeploySchema

    from server.replicas import app_builder
    from specserve_configs import shipped

    config = yaml.safe_load(shipped("ray", "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)  # what `serve deploy` checks
    (app,) = schema.applications
    assert app.import_path == "server.replicas:app_builder"
    built = app_builder(dict(app.args))
    engine = built._bound_deployment.init_args[0]  # Ingress(engine, board, max_body)
    deployment = engine._bound_deployment
    assert deployment.name == "EngineReplica"
    assert deployment._deployment_config.autoscaling_config.max_replicas == app.args["max_replicas"]
    with pytest.raises(ValueError, match="max-replicas"):
        app_builder({**app.args, "max_replicas": 1})
