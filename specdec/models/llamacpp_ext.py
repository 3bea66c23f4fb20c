"""ctypes bindings for the parts of llama.cpp's staging API (``src/llama-ext.h``) that EAGLE-3 needs.

llama.cpp's own draft-eagle3 reads the target's layer inputs through ``llama_set_embeddings_layer_inp``
and ``llama_get_embeddings_layer_inp``, and the token embedding through ``llama_model_get_tok_embd``.
llama-ext.h is C++ without ``extern "C"``, so libllama exports them under their mangled (Itanium ABI)
names and llama-cpp-python binds none of them: they are looked up here in the very library
llama-cpp-python loaded (``llama_cpp.llama_cpp._lib``), so they act on the same contexts and models.

What llama.cpp keeps (llama-context.cpp, ``extract_layer_inputs`` and ``output_reorder``): once a
layer's input is switched on, every ``llama_decode`` copies that layer's input for *every* token of
the batch, whatever its logits flag, into a float32 buffer [n_tokens, n_embd] in batch order, valid
until the next decode. Only model graphs that record their layer inputs support it (``ARCHITECTURES``);
for any other one llama.cpp aborts the process, so the runner asks ``supported`` first.
"""

from __future__ import annotations

import ctypes

# (name in llama-ext.h, mangled name in libllama, result type, argument types)
_SYMBOLS = {
    "set_layer_inp": ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                      None, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]),
    "get_layer_inp": ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                      ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_uint32]),  # float * as an address
    "get_tok_embd": ("llama_model_get_tok_embd", "_Z24llama_model_get_tok_embdPK11llama_modelPf",
                     ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)]),
}
# what an EAGLE-3 head run as llama.cpp's own ``eagle3`` model needs (models/llamacpp_head.py): its
# pre-norm output g (the encoder's fc output, each decoder step's state) and its target layer ids
_HEAD_SYMBOLS = {
    "set_nextn": ("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb",
                  None, [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool]),
    "get_nextn": ("llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context",
                  ctypes.c_void_p, [ctypes.c_void_p]),  # float * as an address
    "target_layer_ids_n": ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
                           ctypes.c_uint32, [ctypes.c_void_p]),
}
# GGUF architectures whose llama.cpp graph records its layer inputs (res->t_layer_inp in src/models/*.cpp)
# among those specdec converts: llama (Llama and Mistral checkpoints); qwen2 and qwen3 do not
ARCHITECTURES = ("llama",)
_bound: dict = {}


def supported(architecture: str) -> str | None:
    """None when this llama-cpp-python build gives the layer inputs of a model of ``architecture``;
    else why not, in a sentence that names the backend that can."""
    if architecture not in ARCHITECTURES:
        return (f"llama.cpp records the layer inputs that EAGLE-3 heads read only for {', '.join(ARCHITECTURES)} "
                f"models, not for {architecture!r} ones; use backend='torch' for this target")
    try:
        functions()
    except ValueError as e:
        return str(e)
    return None


def functions() -> dict:
    """The bound functions by short name (``set_layer_inp``, ``get_layer_inp``, ``get_tok_embd``);
    ValueError when the loaded libllama does not export them."""
    if _bound:
        return _bound
    out, missing, version, name = _bind(_SYMBOLS)
    if missing:
        raise ValueError(f"this llama-cpp-python build ({version}, {name}) does "
                         f"not export {', '.join(missing)} (llama-ext.h), through which specdec reads the target's "
                         "hidden states that EAGLE-3 heads need; use backend='torch', or install the build specdec "
                         "pins (`make install`, llama-cpp-python 0.3.36)")
    _bound.update(out)
    return _bound


def head_functions() -> dict:
    """``functions()`` and the bindings an EAGLE-3 head in llama.cpp needs (``set_nextn``, ``get_nextn``,
    ``target_layer_ids_n``); ValueError naming what the loaded libllama does not export."""
    out = dict(functions())
    head, missing, version, name = _bind(_HEAD_SYMBOLS)
    if missing:
        raise ValueError(f"this llama-cpp-python build ({version}, {name}) does not export {', '.join(missing)} "
                         "(llama-ext.h), through which an EAGLE-3 head runs inside llama.cpp; the torch head runs "
                         "instead (or install the build specdec pins: `make install`, llama-cpp-python 0.3.36)")
    out.update(head)
    return out


def _bind(symbols: dict) -> tuple[dict, list[str], str, str]:
    """Look ``symbols`` up in the libllama llama-cpp-python loaded: (bound functions by short name,
    names not exported, llama-cpp-python's version, the library's file name)."""
    import llama_cpp
    from llama_cpp import llama_cpp as low

    lib = low._lib  # the CDLL llama-cpp-python loaded: libllama of this build
    out, missing = {}, []
    for short, (name, mangled, restype, argtypes) in symbols.items():
        try:
            f = getattr(lib, mangled)
        except AttributeError:
            missing.append(name)
            continue
        f.restype, f.argtypes = restype, argtypes
        out[short] = f
    return out, missing, getattr(llama_cpp, "__version__", "?"), lib._name
