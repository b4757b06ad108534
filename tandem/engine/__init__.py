"""The engine: EngineCore and its overlap loop, the engine-core process, its clients and data-parallel replicas."""
