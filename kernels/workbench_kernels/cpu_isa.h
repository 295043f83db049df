// The vector ISA levels of the C++ CPU kernels and the cap that WORKBENCH_CPU_ISA puts on them: one definition,
// included by weight_only_cpu.cpp, act_int8_cpu.cpp and w8a8_cpu.cpp (each decides for itself what its Avx512 level
// needs from the CPU). isa.py sets the variable so that one machine runs the code an AVX2-only or a plain x86-64 CPU
// would (the tests of the other CPU classes); unset, "auto" or "avx512": no cap.
#pragma once

#include <torch/extension.h>

#include <cstdlib>
#include <string>

namespace {

enum class Isa { Scalar, Avx2, Avx512 };  // ordered: each runs where the later ones can

Isa isa_cap() {
  const char* v = std::getenv("WORKBENCH_CPU_ISA");
  const std::string s = v ? v : "";
  if (s.empty() || s == "auto" || s == "avx512") return Isa::Avx512;
  if (s == "avx2") return Isa::Avx2;
  TORCH_CHECK(s == "scalar", "WORKBENCH_CPU_ISA must be auto, avx512, avx2 or scalar, got '", s, "'");
  return Isa::Scalar;
}

}  // namespace
