"""A contract type for import-linter that its built-in ones cannot express: it sees an external package only whole
(`torch`), so "only tandem.distributed imports torch.distributed" is checked here from the import lines themselves."""

from __future__ import annotations

import re
from typing import Any

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class ExternalSubmoduleContract(Contract):
    """Only `allowed_importers` (and the modules inside them) import `submodule` of an external package, in any
    form: `import a.b`, `import a.b as x`, `from a.b import y`, `from a import b`."""

    submodule = fields.StringField()
    allowed_importers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        root, _, leaf = self.submodule.rpartition(".")
        top = self.submodule.split(".")[0]
        pattern = re.compile(rf"\b{re.escape(self.submodule)}\b|\bfrom\s+{re.escape(root)}\s+import\s+.*\b{leaf}\b")
        allowed = [str(a) for a in self.allowed_importers]  # type: ignore[attr-defined]
        found = []
        for importer in sorted(graph.find_modules_that_directly_import(top)):
            if any(importer == a or importer.startswith(a + ".") for a in allowed):
                continue
            for detail in graph.get_import_details(importer=importer, imported=top):
                if pattern.search(detail["line_contents"]):
                    found.append((importer, detail["line_number"], detail["line_contents"]))
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, line, text in check.metadata["found"]:
            output.print_error(f"{importer} imports {self.submodule} (l.{line}): {text}")
        output.new_line()
