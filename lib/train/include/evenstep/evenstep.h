// Everything a training loop uses, in one include: Session (balanced steps,
// model parts, checkpoints, resume, logs), loop variables kept across a
// resume (Kept, KeptSum), the --evenstep_* flags and
// SetFlagDefaults, and the torch::data adapters (BatchesOf, UniformLengths).
#pragma once

#include "evenstep/data_loader.h"
#include "evenstep/flags.h"
#include "evenstep/kept.h"
#include "evenstep/session.h"
#include "evenstep/torch_data.h"
