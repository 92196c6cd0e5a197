import inspect

from onnxruntime.quantization import qdq_quantizer, quantize

from quantkit.qdq import ortquant


def test_extra_option_keys_exist_in_onnxruntime():
    """ORT ignores unknown extra_options keys silently: every key we pass must appear in its source."""
    source = inspect.getsource(quantize) + inspect.getsource(qdq_quantizer) + \
        inspect.getsource(qdq_quantizer.BaseQuantizer)
    used = {key for settings in ortquant.FLAVOUR_SETTINGS.values() for key in settings.extra_options}
    assert used <= ortquant.KNOWN_EXTRA_OPTIONS
    for key in used:
        assert f'"{key}"' in source, key


def test_dry_run_matches_what_quantize_needs(residual):
    """Every range the dry run lists is one quantize() asks for: quantizing with exactly those works."""
    from quantkit.qdq.placement import CPU, TRT, quantizable_nodes, select_nodes

    model, ranges = residual
    for flavour in (CPU, TRT):
        nodes = select_nodes(quantizable_nodes(model), flavour)
        needed = ortquant.tensors_needing_ranges(model, nodes, flavour)
        bounds = {name: ranges[name].cpu_bounds() for name in needed}
        ortquant.quantize(model, nodes, bounds, flavour)  # raises if one is missing
