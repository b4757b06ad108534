"""The LoRA adapters the API serves by name: `--lora-modules` and /v1/load_lora_adapter add them, a request's `model`
picks one, /v1/unload_lora_adapter removes it. With several API processes they share one AdapterTable, so a run-time
load or unload reaches every one of them."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tandem.lora.peft import check_modules, load_adapter
from tandem.lora_request import LoRARequest
from tandem.server.protocol import ApiError


def adapter_id(name: str, path: str, load: int = 0) -> int:
    """A positive id from the adapter's name, folder and load (the server's count of run-time loads when it was
    loaded; 0 for `--lora-modules`): the engine keys its host copies, device slots and the prefix cache by it, so an
    adapter loaded again, whose folder may hold new weights by then, is never served from what the old one left."""
    digest = hashlib.blake2b(f"{name}\0{path}\0{load}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2 | 1


class AdapterTable:
    """The adapters served, name -> (PEFT folder, id), and the count of loads so far (for new ids). With a `folder`,
    shared by a server's API processes (the launcher creates it with the `--lora-modules` adapters; the API processes
    inherit it at spawn): a load or unload rewrites the JSON file whole under an exclusive lock, then bumps a version
    counter in shared memory; a process reads the file again only when the counter has moved since its last read
    (one integer compared per lookup). Without one, held in this process's memory."""

    def __init__(self, folder: str | None, initial: dict[str, str]) -> None:
        self.path = None if folder is None else os.path.join(folder, "adapters.json")
        self.shared = folder is not None
        self._version = mp.get_context("spawn").RawValue("q", 0) if self.shared else ctypes.c_int64(0)
        self._memory: dict = {}
        with self._locked():
            self._write({"loads": 0, "adapters": {name: [path, adapter_id(name, path)]
                                                  for name, path in initial.items()}})

    @property
    def version(self) -> int:
        return self._version.value

    def read(self) -> tuple[int, dict[str, tuple[str, int]]]:
        """(version, name -> (folder, id)): the file is replaced before the version moves, so it is at least that new."""
        version = self._version.value
        return version, {name: (path, lora_id) for name, (path, lora_id) in self._read()["adapters"].items()}

    def update(self, change: Callable[[dict[str, tuple[str, int]], int], None]) -> None:
        """change(names, load) edits name -> (folder, id) in place, `load` the count of loads before this one (for a
        new id); an exception from change writes nothing."""
        with self._locked():
            table = self._read()
            names = {name: (path, lora_id) for name, (path, lora_id) in table["adapters"].items()}
            change(names, table["loads"])
            self._write({"loads": table["loads"] + 1, "adapters": {n: list(v) for n, v in names.items()}})
            self._version.value += 1

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self.path is None:
            yield
            return
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict:
        if self.path is None:
            return self._memory
        with open(self.path) as f:
            return json.load(f)

    def _write(self, table: dict) -> None:
        if self.path is None:
            self._memory = table
            return
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f)
        os.replace(tmp, self.path)  # readers see the old file or the new one, never a part


class ServedAdapters:
    """Adapter name -> LoRARequest. Each is read and checked against the base model's projections
    (`modules`: Hugging Face module name -> [in, out]) before a request may name it. `table`: the names every API
    process of the server serves (several API processes); None: this process's own."""

    def __init__(self, enabled: bool, base_names: list[str], modules: dict[str, list[int]], max_rank: int,
                 table: AdapterTable | None = None) -> None:
        self.enabled = enabled
        self.base_names = base_names
        self.modules = modules
        self.max_rank = max_rank
        self.table = table if table is not None else AdapterTable(None, {})
        self._by_name: dict[str, LoRARequest] = {}
        self._seen = -1  # the table's version _by_name was read at

    @property
    def by_name(self) -> dict[str, LoRARequest]:
        """Every adapter served now (read from the table again when it changed: here, or in another API process)."""
        if self.table.version != self._seen:
            self._seen, names = self.table.read()
            old = self._by_name
            self._by_name = {name: old[name] if name in old and old[name].lora_int_id == lora_id
                             else LoRARequest(name, lora_id, path) for name, (path, lora_id) in names.items()}
        return self._by_name

    def serve_from_start(self, modules: dict[str, str]) -> None:
        """The `--lora-modules` adapters, each read and checked (ValueError naming it: the server does not start).
        A shared table has them from the launcher already, less those unloaded or replaced since; this process's
        own table takes them now."""
        for name in modules:
            if name in self.base_names:
                raise ValueError(f"--lora-modules: {name!r} is the base model's name")
        if not self.table.shared:
            self.table.update(lambda names, _: names.update(
                {name: (path, adapter_id(name, path)) for name, path in modules.items()}))
        for name, path in modules.items():
            lora = self.by_name.get(name)
            if lora is not None and lora.lora_int_id == adapter_id(name, path):
                self._check(lora)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name this server does not serve."""
        if model is None or model in self.base_names:
            return None
        served = self.by_name
        lora = served.get(model)
        if lora is None:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.base_names[0]!r}"
                                + (f" and the adapters {sorted(served)}" if served else ""),
                           type="not_found_error", param="model", code="model_not_found")
        return lora

    def load(self, name: str, path: str, inplace: bool = False) -> tuple[LoRARequest, LoRARequest | None]:
        """Reads and checks an adapter and serves it as `name`: (it, the adapter it replaces under that name, with
        inplace; else None). Each load gets an id of its own, so the folder is read again even where its path is
        the same. ValueError with the reason when it cannot serve (nothing then changes)."""
        if not self.enabled:
            raise ValueError("LoRA adapters are off: start the server with --enable-lora")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("lora_name and lora_path must be non-empty strings")
        if name in self.base_names:
            raise ValueError(f"{name!r} is the base model's name")
        made: list[LoRARequest | None] = []

        def add(names: dict[str, tuple[str, int]], loads: int) -> None:
            old = names.get(name)
            if old is not None and not inplace:  # (with a shared table, maybe loaded by another API process)
                raise ValueError(f"an adapter named {name!r} is already loaded (load_inplace replaces it)")
            request = LoRARequest(name, adapter_id(name, path, loads + 1), path)
            self._check(request)  # under a shared table's lock: a bad adapter changes nothing
            names[name] = (path, request.lora_int_id)
            made[:] = [request, None if old is None else LoRARequest(name, old[1], old[0])]

        self.table.update(add)
        return made[0], made[1]  # type: ignore[return-value]

    def unload(self, name: str) -> LoRARequest:
        lora = self.by_name.get(name)

        def drop(names: dict[str, tuple[str, int]], loads: int) -> None:
            if names.pop(name, None) is None:  # (with a shared table, unloaded by another API process meanwhile)
                raise KeyError(name)

        if lora is not None:
            try:
                self.table.update(drop)
            except KeyError:
                lora = None
        if lora is None:
            raise ApiError(404, f"no adapter named {name!r} is loaded", type="not_found_error", param="lora_name",
                           code="model_not_found")
        return lora

    def _check(self, request: LoRARequest) -> None:
        check_modules(load_adapter(request, self.max_rank), self.modules)
