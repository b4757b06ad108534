from tests.engine.conftest import idle_llm, llm  # noqa: F401  (the shared embedded-model fixtures)
