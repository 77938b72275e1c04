// Host stand-in for <poplar/HalfFloat.hpp>: IEEE binary16 as the compiler's
// _Float16, which converts to and from float with round to nearest even like
// the IPU's half.
#pragma once

using half = _Float16;
