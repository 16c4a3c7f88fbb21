"""phloem runtime: engine, scheduler, caches, model execution. Import submodules directly."""
