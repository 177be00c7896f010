// CPU kernels of the engine: an int8 linear layer whose weights stream from memory once
// however many rows it multiplies, and float32 attention whose result for one query never
// depends on the other queries in the pass.
//
// Batch invariance is the point of both. Verifying a draft tree must give every node the very
// logits a one-token step gives, so every sum a row's result depends on is taken in an order
// fixed by that row alone: integer sums are exact, and each float sum in these parts runs over one
// row's own elements in one fixed order, whatever the number of rows, threads or the tree.
// Built with -ffp-contract=off so the compiler fuses no multiply-add the code did not write.
//
// Paths by instruction set, chosen at compile time (-march) inside each kernel: scalar (the
// reference), AVX2, AVX-512 (quantizers, attention, epilogues) with VNNI (the int8, block and
// K-quant dot products), and AMX's tiles for int8 passes of 4 or more rows and K-quant passes of
// 16 or more (amx.h, used where the kernel grants the process tile state). Every path
// gives the same bits; a CPU without one still builds and tests it: -DSPECDEC_SIMDE emulates
// AVX-512 VNNI through SIMDe's headers, -DSPECDEC_EMULATE_AMX the tiles in plain C++
// (kernels/__init__.py build(emulate=...)).
//
// One translation unit, its parts by what they hold: common.h (headers, row and thread helpers,
// cache element types), simde_avx512.h (the emulation), amx.h (the tiles and their twin),
// int8.h, blocks.h and kquants.h (a weight format each: activation quantizers, dot products,
// the layer and its passes), attention.h, decoder_layer.h; the Python module below. Each
// kernel's paths stay side by side, the scalar reference beside the vector code that must equal it.
#include "common.h"
#include "amx.h"
#include "int8.h"
#include "blocks.h"
#include "kquants.h"
#include "attention.h"
#include "decoder_layer.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack_weight", &pack_weight);
  // The dtype of the caches the native layers read fastest on this CPU.
  module.def("cache_dtype", [] { return std::string(kBfloat16Cache ? "bfloat16" : "float16"); });
  module.def("weight_sums", &weight_sums);
  // The passes run without Python's lock: a service's gRPC threads take requests and send
  // replies while its compute thread is inside a layer, instead of waiting for the
  // interpreter's switch interval (5 ms) to win the lock from it.
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  module.def("int8_linear", &int8_linear, unlocked);
  module.def("attention", &attention, unlocked);
  py::class_<LayerWeights>(module, "LayerWeights").def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, double>());
  module.def("block_linear", &block_linear, unlocked);
  module.def("kquant_linear", &kquant_linear, unlocked);
  module.def("native_decoder_layer", &native_decoder_layer, unlocked);
  // Whether the int8 and K-quant layers multiply through AMX's tiles (emulated in a
  // SPECDEC_EMULATE_AMX build); `enabled` switches them on or off where they exist.
  module.def("tiles", [](c10::optional<bool> enabled) {
#if defined(SPECDEC_AMX)
    if (enabled) use_tiles = *enabled;
    return use_tiles && tiles::available();
#else
    return false;
#endif
  }, py::arg("enabled") = py::none());
}
