#include "evenstep/device_feed.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "evenstep/internal/device_compat.h"

namespace evenstep {

namespace {
// Each tensor's place in the staging buffer is aligned to this many bytes.
constexpr int64_t kAlign = 64;

int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t PowerOfTwoAtLeast(int64_t n) {
  int64_t p = 4096;
  while (p < n) p *= 2;
  return p;
}
}  // namespace

struct DeviceFeeder::Buffer {
  at::Tensor bytes;  // kByte, CPU (page-locked when pinned)
};

DeviceFeeder::DeviceFeeder(c10::Device device, bool pinned) : device_(device), pinned_(pinned) {}

DeviceFeeder::~DeviceFeeder() = default;

std::unique_ptr<DeviceFeeder::Buffer> DeviceFeeder::Acquire(int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The smallest free buffer that fits; a smaller one is dropped (the
    // largest micro-batch sets the size, so the pool stays at one size).
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i]->bytes.numel() >= bytes) {
        std::unique_ptr<Buffer> b = std::move(free_[i]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return b;
      }
    }
    if (!free_.empty()) {
      buffer_bytes_ -= free_.back()->bytes.numel();
      free_.pop_back();
      --buffers_;
    }
  }
  auto b = std::make_unique<Buffer>();
  const int64_t size = PowerOfTwoAtLeast(bytes);
  b->bytes = at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned_));
  std::lock_guard<std::mutex> lock(mu_);
  ++buffers_;
  buffer_bytes_ += size;
  return b;
}

void DeviceFeeder::Release(std::unique_ptr<Buffer> buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(std::move(buffer));
}

int DeviceFeeder::buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return buffers_;
}

int64_t DeviceFeeder::buffer_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return buffer_bytes_;
}

void DeviceFeeder::Feed(const std::vector<at::Tensor*>& tensors) {
  std::vector<at::Tensor*> moving;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (at::Tensor* t : tensors) {
    if (!t->defined() || !t->device().is_cpu()) continue;
    moving.push_back(t);
    offsets.push_back(total);
    total += AlignUp(static_cast<int64_t>(t->numel() * t->element_size()));
  }
  if (moving.empty()) return;
  std::unique_ptr<Buffer> buffer = Acquire(total);
  // Release the buffer on every path: a throwing copy must not leak it.
  struct Returner {
    DeviceFeeder* feeder;
    std::unique_ptr<Buffer>* buffer;
    ~Returner() { feeder->Release(std::move(*buffer)); }
  } returner{this, &buffer};
  // Staged views: each tensor's bytes, contiguous, at its offset.
  std::vector<at::Tensor> staged;
  staged.reserve(moving.size());
  for (size_t i = 0; i < moving.size(); ++i) {
    const at::Tensor& src = *moving[i];
    const int64_t n = src.numel() * static_cast<int64_t>(src.element_size());
    at::Tensor view = buffer->bytes.narrow(0, offsets[i], n).view(src.scalar_type());
    view = view.view(src.sizes());
    view.copy_(src);
    staged.push_back(std::move(view));
  }
  if (device_.is_cpu()) {
    // No device: the copies are the staged values in their own memory.
    for (size_t i = 0; i < moving.size(); ++i) *moving[i] = staged[i].clone();
    return;
  }
  const c10::impl::VirtualGuardImpl guard(device_.type());
  const c10::Stream side = guard.getStreamFromGlobalPool(device_);
  std::vector<at::Tensor> out;
  out.reserve(moving.size());
  {
    // Allocated and written on the side stream; Adopt records the use by
    // the training stream.
    c10::StreamGuard on_side(side);
    for (const at::Tensor& s : staged) {
      at::Tensor dst = at::empty(s.sizes(), s.options().device(device_).pinned_memory(false));
      dst.copy_(s, /*non_blocking=*/true);
      out.push_back(std::move(dst));
    }
  }
  // The staging buffer is reused once these copies have landed.
  c10::Event copied(device_.type());
  copied.record(side);
  internal::device_compat::Synchronize(copied);
  for (size_t i = 0; i < moving.size(); ++i) *moving[i] = std::move(out[i]);
}

void DeviceFeeder::Adopt(const std::vector<at::Tensor*>& tensors) const {
  if (device_.is_cpu()) return;
  const c10::impl::VirtualGuardImpl guard(device_.type());
  const c10::Stream current = guard.getStream(device_);
  for (const at::Tensor* t : tensors) {
    if (t->defined() && t->device() == device_) {
      guard.recordDataPtrOnStream(t->storage().data_ptr(), current);
    }
  }
}

}  // namespace evenstep
