import jdp

PUBLIC = sorted(jdp.__all__)


def test_public_names_are_pinned():
    # Changing the public surface is deliberate: update this list with it.
    assert PUBLIC == sorted(
        [
            "BMUFState",
            "Collective",
            "MemoryAnalysis",
            "Parallel",
            "ReplicaDivergenceError",
            "TrainState",
            "all_reduce_gradients",
            "assert_replicas_in_sync",
            "bmuf",
            "bmuf_global_params",
            "broadcast",
            "export_predictor",
            "load_predictor",
            "make_train_step",
            "parallelize",
            "replica_key",
            "replicas_in_sync",
            "save_predictor",
            "sync_batch_stats",
            "sync_gradients",
        ]
    )


def test_public_subpackages_are_pinned():
    import jdp.checkpoint
    import jdp.distributed
    import jdp.launch
    import jdp.sparse

    assert jdp.checkpoint.__all__ == ["CheckpointManager"]
    assert sorted(jdp.distributed.__all__) == [
        "initialize",
        "is_initialized",
        "shutdown",
    ]
    assert jdp.launch.__all__ == ["run"]
    assert jdp.metrics.__all__ == ["gather", "sum"]
    assert sorted(jdp.sparse.__all__) == sorted(
        [
            "AdagradRowState",
            "AdamRowState",
            "IdsOutOfRangeError",
            "IndexedRows",
            "MomentumRowState",
            "PartitionState",
            "RowOptimizer",
            "SparseTransformation",
            "adagrad",
            "adam",
            "all_gather_rows",
            "combine_rows",
            "lookup",
            "make_train_step",
            "momentum",
            "partition",
            "sgd",
            "value_and_grad",
        ]
    )
    for module in (
        jdp.checkpoint,
        jdp.distributed,
        jdp.launch,
        jdp.metrics,
        jdp.sparse,
    ):
        for name in module.__all__:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name}"


def test_every_public_name_exists_and_is_documented():
    for name in PUBLIC:
        obj = getattr(jdp, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name
