// The variational autoencoder of samples/vae_plain.cc and samples/vae.cc,
// in the shape of prabhuomkar/pytorch-cpp's variational autoencoder
// tutorial (written here in its shape, not copied): a 784-400-20 encoder
// giving mu and log-variance, the reparameterisation's random draw while
// training, a 20-400-784 sigmoid decoder; and SaveImage, which writes
// images as one binary PGM grid (the tutorial writes PNGs through a helper
// of its own). The data is SyntheticDigits (dist_mnist_common.h).
#pragma once

#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "samples/dist_mnist_common.h"

namespace evenstep::samples {

struct VAEOutput {
  torch::Tensor reconstruction, mu, log_var;
};

class VAEImpl : public torch::nn::Module {
 public:
  VAEImpl(int64_t image_size, int64_t h_dim, int64_t z_dim)
      : fc1_(image_size, h_dim),
        fc2_(h_dim, z_dim),
        fc3_(h_dim, z_dim),
        fc4_(z_dim, h_dim),
        fc5_(h_dim, image_size) {
    register_module("fc1", fc1_);
    register_module("fc2", fc2_);
    register_module("fc3", fc3_);
    register_module("fc4", fc4_);
    register_module("fc5", fc5_);
  }
  VAEOutput forward(torch::Tensor x) {
    torch::Tensor h = torch::relu(fc1_->forward(x));
    torch::Tensor mu = fc2_->forward(h), log_var = fc3_->forward(h);
    torch::Tensor z = mu;
    if (is_training()) {
      torch::Tensor std = torch::exp(log_var / 2);
      z = mu + torch::randn_like(std) * std;
    }
    return {decode(z), mu, log_var};
  }
  torch::Tensor decode(torch::Tensor z) {
    return torch::sigmoid(fc5_->forward(torch::relu(fc4_->forward(z))));
  }

 private:
  torch::nn::Linear fc1_, fc2_, fc3_, fc4_, fc5_;
};
TORCH_MODULE(VAE);

// `images` [N, 1, H, W] in [0, 1] as one row of N images, an 8-bit PGM.
inline void SaveImage(const torch::Tensor& images, const std::string& path) {
  const torch::Tensor grid = images.detach().to(torch::kCPU).squeeze(1).permute({1, 0, 2});
  const torch::Tensor bytes =
      (grid.reshape({grid.size(0), -1}) * 255).clamp(0, 255).to(torch::kU8).contiguous();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::perror(path.c_str());
    return;
  }
  std::fprintf(f, "P5\n%lld %lld\n255\n", static_cast<long long>(bytes.size(1)),
               static_cast<long long>(bytes.size(0)));
  std::fwrite(bytes.data_ptr<uint8_t>(), 1, static_cast<size_t>(bytes.numel()), f);
  std::fclose(f);
}

}  // namespace evenstep::samples
