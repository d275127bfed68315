// The one place that knows how the c10d C++ API differs between libtorch
// releases. Everything else in evenstep creates stores and process groups
// through these functions. (How c10::Event is waited for and timed, which
// also differs, is device-generic and lives in base/:
// evenstep/internal/device_compat.h.)
//
//  - libtorch 1.13: ProcessGroupGloo / ProcessGroupNCCL derive from
//    c10d::ProcessGroup and are used directly.
//  - libtorch 2.x: they derive from c10d::Backend; a c10d::ProcessGroup wraps
//    them (setBackend per device type). 2.0-2.2 construct the ProcessGroup
//    with an Options argument, later releases without.
//
// The version macros pick the path; cmake/EvenstepTorchCompat.cmake confirms it
// with try-compiles and writes evenstep/internal/build_config.h. Functions here
// throw what c10d throws (c10::Error, std::exception); callers turn that into
// absl::Status at their boundary. Thread-safety: stateless.
#pragma once

#include <torch/version.h>

#include <chrono>
#include <initializer_list>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "evenstep/internal/build_config.h"

#if EVENSTEP_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#if !defined(USE_C10D_GLOO)
#error "evenstep needs USE_C10D_GLOO defined (the evenstep_torch target sets it)"
#endif

namespace evenstep::internal::c10d_compat {

using StorePtr = c10::intrusive_ptr<::c10d::Store>;
using ProcessGroupPtr = c10::intrusive_ptr<::c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<::c10d::Work>;

inline constexpr int kTorchMajor = TORCH_VERSION_MAJOR;
inline constexpr int kTorchMinor = TORCH_VERSION_MINOR;

// A TCPStore client (or server when `is_server`) for host:port. `port` 0 with
// `is_server` lets the OS choose; read it back with TcpStorePort.
inline StorePtr MakeTcpStore(const std::string& host, int port, bool is_server,
                             std::chrono::milliseconds timeout) {
  ::c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = is_server;
  options.waitWorkers = false;
  options.timeout = timeout;
  return c10::make_intrusive<::c10d::TCPStore>(host, options);
}

inline int TcpStorePort(const ::c10d::Store& store) {
  return static_cast<const ::c10d::TCPStore&>(store).getPort();
}

inline StorePtr MakeHashStore() { return c10::make_intrusive<::c10d::HashStore>(); }

inline StorePtr MakePrefixStore(const std::string& prefix, StorePtr store) {
  return c10::make_intrusive<::c10d::PrefixStore>(prefix, std::move(store));
}

// Wraps a backend into a ProcessGroup on 2.x; the identity on 1.x.
// `devices`: the device types whose tensors the backend reduces.
template <typename BackendT>
ProcessGroupPtr AsProcessGroup(const StorePtr& store, int rank, int size,
                               c10::intrusive_ptr<BackendT> backend,
                               std::initializer_list<c10::DeviceType> devices, const char* name) {
#if EVENSTEP_GLOO_IS_PROCESS_GROUP
  (void)store;
  (void)rank;
  (void)size;
  (void)devices;
  (void)name;
  return backend;
#else
#if EVENSTEP_PG_CTOR_TAKES_OPTIONS
  auto group = c10::make_intrusive<::c10d::ProcessGroup>(
      store, rank, size, c10::make_intrusive<::c10d::ProcessGroup::Options>(name));
#else
  auto group = c10::make_intrusive<::c10d::ProcessGroup>(store, rank, size);
#endif
  const auto type = std::string(name) == "nccl" ? ::c10d::ProcessGroup::BackendType::NCCL
                                                : ::c10d::ProcessGroup::BackendType::GLOO;
  for (const c10::DeviceType device : devices) group->setBackend(device, type, backend);
#if !EVENSTEP_PG_CTOR_TAKES_OPTIONS
  group->setDefaultBackend(type);
#endif
  return group;
#endif
}

// A Gloo process group. `hostname_or_interface` selects the transport device:
// "if:<name>" for a network interface, a host name or address otherwise, and
// empty for Gloo's default (the address the host name resolves to).
inline ProcessGroupPtr MakeGlooGroup(const StorePtr& store, int rank, int size,
                                     std::chrono::milliseconds timeout,
                                     const std::string& hostname_or_interface) {
  auto options = ::c10d::ProcessGroupGloo::Options::create(timeout);
  if (hostname_or_interface.rfind("if:", 0) == 0) {
    options->devices.push_back(
        ::c10d::ProcessGroupGloo::createDeviceForInterface(hostname_or_interface.substr(3)));
  } else if (!hostname_or_interface.empty()) {
    options->devices.push_back(
        ::c10d::ProcessGroupGloo::createDeviceForHostname(hostname_or_interface));
  } else {
    options->devices.push_back(::c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto gloo = c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, options);
  // CUDA tensors too, as init_process_group("gloo") registers it: ranks
  // that share one GPU reduce over Gloo (NCCL refuses two ranks on one
  // device). Without it a CUDA tensor's collective fails with "No backend
  // type associated with device type cuda".
  return AsProcessGroup(store, rank, size, gloo, {c10::DeviceType::CPU, c10::DeviceType::CUDA},
                        "gloo");
}

#if EVENSTEP_HAVE_NCCL
inline ProcessGroupPtr MakeNcclGroup(const StorePtr& store, int rank, int size,
                                     std::chrono::milliseconds timeout) {
  auto options = ::c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<::c10d::ProcessGroupNCCL>(store, rank, size, options);
  return AsProcessGroup(store, rank, size, nccl, {c10::DeviceType::CUDA}, "nccl");
}
#endif

inline std::string BackendName(const ::c10d::ProcessGroup& group) { return group.getBackendName(); }

}  // namespace evenstep::internal::c10d_compat
