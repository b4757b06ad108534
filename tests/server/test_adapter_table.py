"""The adapters a server's API processes share (AdapterTable): a run-time load or unload in one process is what
every other serves from its next lookup; a name loaded twice at once is refused once; an adapter unloaded at run
time is not served again by a replaced process; a load in place gives a new id (the folder is read again); a process
reads the table only when it moved."""

from __future__ import annotations

import pytest

from tandem.lora.peft import load_adapter
from tandem.server.adapters import AdapterTable, ServedAdapters, adapter_id
from tandem.server.protocol import ApiError
from tests.lora.adapters import save_adapter, save_base

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("table")
    base = save_base("llama", str(root / "base"))
    return {name: save_adapter(base, str(root / name), ["q_proj", "down_proj"], r=4, seed=i)
            for i, name in enumerate(("sql", "chat", "math"))}


def _process(table: AdapterTable, folders: dict[str, str]) -> ServedAdapters:
    """What one API process holds: its ServedAdapters over the shared table, checked against the base's shapes."""
    from tandem.lora_request import LoRARequest

    weights = load_adapter(LoRARequest("x", 1, folders["sql"]), 8).weights
    modules = {m: [a.shape[1], b.shape[0]] for m, (a, b) in weights.items()}
    return ServedAdapters(True, ["base"], modules, 8, table)


def test_a_load_or_unload_in_one_process_reaches_the_others(folders, tmp_path):
    table = AdapterTable(str(tmp_path), {"sql": folders["sql"]})
    first, second = _process(table, folders), _process(table, folders)
    for p in (first, second):
        p.serve_from_start({"sql": folders["sql"]})
        assert p.resolve("sql").lora_int_id == adapter_id("sql", folders["sql"])
    first.load("chat", folders["chat"])
    assert second.resolve("chat").lora_path == folders["chat"] and set(second.by_name) == {"sql", "chat"}
    with pytest.raises(ValueError, match="already loaded"):
        second.load("chat", folders["math"])
    assert second.unload("sql").lora_path == folders["sql"]
    with pytest.raises(ApiError, match="does not exist") as err:
        first.resolve("sql")
    assert err.value.status == 404
    with pytest.raises(ApiError, match="no adapter named 'sql'"):
        first.unload("sql")
    # A replaced API process starts from the table: the start-up adapter unloaded at run time stays unloaded.
    replaced = _process(table, folders)
    replaced.serve_from_start({"sql": folders["sql"]})
    assert set(replaced.by_name) == {"chat"}
    # A name loaded by two processes at once: the other's load lands between this one's lookup and its write;
    # the table has the other's and this one is refused.
    third = _process(table, folders)
    update = table.update

    def racing(change):
        table.update = update
        first.load("math", folders["math"])
        update(change)

    table.update = racing
    with pytest.raises(ValueError, match="'math' is already loaded"):
        third.load("math", folders["sql"])
    assert replaced.resolve("math").lora_path == folders["math"] == third.resolve("math").lora_path


@pytest.mark.parametrize("shared", [True, False], ids=["table", "one-process"])
def test_a_load_in_place_replaces_the_adapter_under_a_new_id(folders, tmp_path, shared):
    table = AdapterTable(str(tmp_path), {"sql": folders["sql"]}) if shared else None
    first, other = _process(table, folders), _process(table, folders)
    first.serve_from_start({"sql": folders["sql"]})
    start = first.resolve("sql")
    assert start.lora_int_id == adapter_id("sql", folders["sql"])
    new, old = first.load("sql", folders["chat"], inplace=True)
    assert old == start and new.lora_path == folders["chat"] and first.resolve("sql") == new
    again, old = first.load("sql", folders["chat"], inplace=True)  # the same folder: read again, under a new id
    assert old == new and again.lora_int_id not in (new.lora_int_id, start.lora_int_id)
    if shared:
        assert other.resolve("sql") == again
    with pytest.raises(ValueError, match="already loaded"):
        first.load("sql", folders["math"])
    with pytest.raises(ValueError, match="not a folder"):  # a bad replacement leaves the adapter served
        first.load("sql", str(tmp_path / "nowhere"), inplace=True)
    assert first.resolve("sql") == again


def test_lookups_read_the_table_only_when_it_moved(folders, tmp_path, monkeypatch):
    table = AdapterTable(str(tmp_path), {"sql": folders["sql"]})
    process, other = _process(table, folders), _process(table, folders)
    assert "sql" in other.by_name
    reads = []
    read = table.read
    monkeypatch.setattr(table, "read", lambda: reads.append(1) or read())
    for _ in range(5):
        process.resolve("sql")
    assert len(reads) == 1
    other.load("chat", folders["chat"])
    process.resolve("chat")
    process.resolve(None)
    assert len(reads) == 2


def test_a_bad_start_up_adapter_fails_the_process_start(folders, tmp_path):
    table = AdapterTable(str(tmp_path), {"bad": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="'bad'"):
        _process(table, folders).serve_from_start({"bad": str(tmp_path / "nowhere")})
    for shared in (table, None):
        with pytest.raises(ValueError, match="'base' is the base model's name"):
            _process(shared, folders).serve_from_start({"base": folders["sql"]})
