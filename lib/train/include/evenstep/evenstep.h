// Everything a training loop uses, in one include: Session (balanced steps,
// model parts, checkpoints, resume, logs), the --evenstep_* flags and
// SetFlagDefaults, and the torch::data adapters (BatchesOf, UniformLengths).
#pragma once

#include "evenstep/flags.h"
#include "evenstep/session.h"
#include "evenstep/torch_data.h"
