/* cuda_runtime_api.h (emulation): the runtime API lives in cuda_runtime.h here. */
#include "cuda_runtime.h"
