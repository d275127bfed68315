// Moving a loaded micro-batch to the training device off the training
// thread.
//
// TensorWalk<Data> finds the tensors in a loaded micro-batch. It knows
// at::Tensor, torch::data::Example<D, T>, std::vector, std::pair,
// std::tuple and std::optional of what it knows; for your own batch type,
// specialise it:
//
//   template <> struct evenstep::TensorWalk<MyBatch> {
//     static constexpr bool kKnown = true;
//     static void Visit(MyBatch& b, const evenstep::TensorVisitor& f) { f(b.ids); f(b.mask); }
//   };
//
// DeviceFeeder::Feed (run by BalancedStep's data workers, with
// --evenstep_pin_memory and a model on an accelerator) replaces each CPU
// tensor by a copy on the device: it stages the tensors in one reusable
// page-locked buffer, copies them with non-blocking copies on a side stream
// of the device (device-generic c10: CUDA, or any backend with streams and
// events), and waits for those copies on the worker thread, so the training
// thread finds the data already on the device. Adopt, on the training
// thread, tells the device's allocator that the current stream uses the new
// tensors (they were allocated on the side stream), so their memory is not
// reused by a later copy while the step still reads it.
//
// Memory: one staging buffer per concurrent Feed (at most the number of
// data workers), each as large as the largest micro-batch fed so far
// (rounded up to a power of two), kept for reuse.
// Thread-safety: Feed from any number of threads; Adopt on the thread whose
// current stream will use the tensors.
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace at {
class Tensor;
}
namespace torch {
namespace data {
template <typename Data, typename Target>
struct Example;
}
}  // namespace torch

namespace evenstep {

using TensorVisitor = std::function<void(at::Tensor&)>;

template <typename Data, typename = void>
struct TensorWalk {
  static constexpr bool kKnown = false;
  static void Visit(Data&, const TensorVisitor&) {}
};

template <>
struct TensorWalk<at::Tensor> {
  static constexpr bool kKnown = true;
  static void Visit(at::Tensor& t, const TensorVisitor& f) { f(t); }
};

template <typename D, typename T>
struct TensorWalk<torch::data::Example<D, T>> {
  static constexpr bool kKnown = TensorWalk<D>::kKnown || TensorWalk<T>::kKnown;
  static void Visit(torch::data::Example<D, T>& e, const TensorVisitor& f) {
    TensorWalk<D>::Visit(e.data, f);
    TensorWalk<T>::Visit(e.target, f);
  }
};

template <typename T>
struct TensorWalk<std::vector<T>> {
  static constexpr bool kKnown = TensorWalk<T>::kKnown;
  static void Visit(std::vector<T>& v, const TensorVisitor& f) {
    for (T& x : v) TensorWalk<T>::Visit(x, f);
  }
};

template <typename T>
struct TensorWalk<std::optional<T>> {
  static constexpr bool kKnown = TensorWalk<T>::kKnown;
  static void Visit(std::optional<T>& v, const TensorVisitor& f) {
    if (v) TensorWalk<T>::Visit(*v, f);
  }
};

template <typename A, typename B>
struct TensorWalk<std::pair<A, B>> {
  static constexpr bool kKnown = TensorWalk<A>::kKnown || TensorWalk<B>::kKnown;
  static void Visit(std::pair<A, B>& p, const TensorVisitor& f) {
    TensorWalk<A>::Visit(p.first, f);
    TensorWalk<B>::Visit(p.second, f);
  }
};

template <typename... Ts>
struct TensorWalk<std::tuple<Ts...>> {
  static constexpr bool kKnown = (TensorWalk<Ts>::kKnown || ...);
  static void Visit(std::tuple<Ts...>& t, const TensorVisitor& f) {
    std::apply([&](Ts&... x) { (TensorWalk<Ts>::Visit(x, f), ...); }, t);
  }
};

// Pointers to the tensors in `data` (valid while `data` lives).
template <typename Data>
std::vector<at::Tensor*> TensorsIn(Data& data) {
  std::vector<at::Tensor*> out;
  TensorWalk<Data>::Visit(data, [&](at::Tensor& t) { out.push_back(&t); });
  return out;
}

class DeviceFeeder {
 public:
  // `device`: where the tensors go. `pinned`: stage in page-locked memory
  // (needs the device's host allocator; false stages in ordinary memory,
  // which tests use on a CPU-only machine with device = CPU).
  DeviceFeeder(c10::Device device, bool pinned);
  ~DeviceFeeder();
  DeviceFeeder(const DeviceFeeder&) = delete;
  DeviceFeeder& operator=(const DeviceFeeder&) = delete;

  // Replaces every defined CPU tensor among `tensors` by a copy on the
  // device (same dtype, shape and values; contiguous) and returns once the
  // copies have landed. Tensors already on the device are left as they are.
  // Throws (c10::Error) if a copy fails.
  void Feed(const std::vector<at::Tensor*>& tensors);
  // Marks the device tensors among `tensors` as used by the calling
  // thread's current stream.
  void Adopt(const std::vector<at::Tensor*>& tensors) const;

  c10::Device device() const { return device_; }
  // Staging buffers allocated so far, and the bytes they hold.
  int buffers() const;
  int64_t buffer_bytes() const;

 private:
  struct Buffer;
  std::unique_ptr<Buffer> Acquire(int64_t bytes);
  void Release(std::unique_ptr<Buffer> buffer);

  const c10::Device device_;
  const bool pinned_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Buffer>> free_;
  int buffers_ = 0;
  int64_t buffer_bytes_ = 0;
};

}  // namespace evenstep
