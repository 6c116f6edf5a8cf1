def test_imports():
    import mindtrain.config, mindtrain.data, mindtrain.models, mindtrain.parallel, mindtrain.trainer  # noqa
