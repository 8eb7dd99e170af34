// runlm's kernels: GGUF-block matrix products, the interleaved weight layouts, attention, KV cache formats and
// whole transformer blocks for the CPU, and the native tokenizer's encoder. One translation unit, split by concern
// into the parts below (each part's first line says what it holds); common.h's opening comment describes the
// scheme. Two builds: with -DRUNLM_STANDALONE a plain C library (the native runtime: api.h's C interface, one library
// per instruction-set variant), else the PyTorch extension (runlm.quant.kernels: api.h's ops).
#include "common.h"
#include "act_quant.h"
#include "dot.h"
#include "types.h"
#include "repack.h"
#include "rows16.h"
#include "gemm.h"
#include "float_gemm.h"
#include "dequant.h"
#include "kv.h"
#include "attention.h"
#include "moe.h"
#include "block.h"
#include "api.h"
#include "unicode_classes.h"
#include "pretok.h"
#include "tokenizer.h"
