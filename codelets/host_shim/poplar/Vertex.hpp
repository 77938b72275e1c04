// Host stand-in for the parts of <poplar/Vertex.hpp> the FP8 codelets use.
//
// popc compiles codelets against the real header for the IPU; this one lets
// g++ compile the very same sources for the host library. Fields are bound to
// plain pointers with connect(), where a Poplar graph would use
// graph.connect(vertex["field"], tensor). MultiVertex::numWorkers() returns
// the worker count the host runner sets, 6 on a real IPU tile.
//
// A Vector field's alignment (its third template argument) is checked when it
// is connected, as Poplar's graph compiler guarantees it on the IPU: a
// misaligned pointer sets host_shim::misaligned(), which the host runner
// reports instead of running the vertex.
#pragma once

#include <cstddef>
#include <cstdint>

namespace poplar {

enum class VectorLayout { ONE_PTR, SPAN, COMPACT_PTR, SCALED_PTR32, SCALED_PTR64 };

template <typename T, VectorLayout Layout = VectorLayout::SPAN, unsigned Alignment = alignof(T),
          bool Interleaved = false>
class Vector {
 public:
  using value_type = T;
  static constexpr unsigned alignment = Alignment;
  void connect(T* data, std::size_t size) {
    data_ = data;
    size_ = size;
  }
  T& operator[](std::size_t i) const { return data_[i]; }
  std::size_t size() const { return size_; }
  T* data() const { return data_; }
  T* begin() const { return data_; }
  T* end() const { return data_ + size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

namespace host_shim {

// Set when a Vector field is connected to memory that breaks its alignment.
inline bool& misaligned() {
  static thread_local bool flag = false;
  return flag;
}

// A scalar field: `*field` reads or writes it, reads also convert implicitly.
template <typename Element>
class ScalarField {
 public:
  void connect(Element* data) { data_ = data; }
  Element& operator*() const { return *data_; }
  operator Element() const { return *data_; }

 private:
  Element* data_ = nullptr;
};

// A vector field: `field[i]`, `field.size()`, iteration.
template <typename Element, unsigned Alignment>
class VectorField {
 public:
  static_assert(Alignment != 0 && (Alignment & (Alignment - 1)) == 0,
                "a Vector's alignment is a power of two");
  static constexpr unsigned alignment = Alignment;

  void connect(Element* data, std::size_t size) {
    if (reinterpret_cast<std::uintptr_t>(data) % Alignment != 0) {
      misaligned() = true;
    }
    vector_.connect(data, size);
  }
  Element& operator[](std::size_t i) const { return vector_[i]; }
  std::size_t size() const { return vector_.size(); }
  Element* begin() const { return vector_.begin(); }
  Element* end() const { return vector_.end(); }

 private:
  Vector<Element> vector_;
};

inline unsigned& workerCount() {
  static thread_local unsigned count = 6;
  return count;
}

}  // namespace host_shim

template <typename T>
class Input : public host_shim::ScalarField<const T> {};
template <typename T, VectorLayout L, unsigned A, bool I>
class Input<Vector<T, L, A, I>> : public host_shim::VectorField<const T, A> {};

template <typename T>
class Output : public host_shim::ScalarField<T> {};
template <typename T, VectorLayout L, unsigned A, bool I>
class Output<Vector<T, L, A, I>> : public host_shim::VectorField<T, A> {};

template <typename T>
class InOut : public host_shim::ScalarField<T> {};
template <typename T, VectorLayout L, unsigned A, bool I>
class InOut<Vector<T, L, A, I>> : public host_shim::VectorField<T, A> {};

class Vertex {};

class MultiVertex {
 public:
  static unsigned numWorkers() { return host_shim::workerCount(); }
};

}  // namespace poplar
