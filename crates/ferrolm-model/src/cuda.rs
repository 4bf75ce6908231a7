//! The model on an NVIDIA GPU (`cuda` feature): the one decoder on the [`Cuda`] device, with
//! what only a GPU runner has: the KV cache in device memory, decode steps replayed from CUDA
//! graphs, GEMM tuning, steps launched ahead, and sampling where the logits are.
//!
//! Per step the host uploads the batch's index buffers (a few KB), the GPU runs every layer and
//! then samples (or takes prompt logprobs) on the logits where they are, and only the chosen
//! tokens and the logprobs asked for come back (`GpuSampler`).

use ferrolm_backend::cuda::{
    AttentionWork, Cuda, CudaKvLayer, CudaMatrix, Fp8GemmShape, Gpu, GpuError, GpuSampler, GpuView, StagedBuffer,
};
use ferrolm_backend::{DType, Device, Linear};
use ferrolm_sampling::{OwnedRowRequest, RowRequest, TokenLogprobs, TokenMasks};

mod graphs;
mod step_buffers;

use graphs::{graph_batch, DecodeGraph, DecodeGraphs, GraphShape, GRAPH_BATCHES};
use step_buffers::{StepBuffers, StepShape};

use crate::activations::Activations;
use crate::config::ModelConfig;
use crate::decoder::Decoder;
use crate::input::ModelInput;
use crate::runner::{check_kv_groups, ModelRunner};
use crate::weights::WeightSource;
use crate::ModelError;

/// The model on one GPU, with its KV cache.
pub struct CudaRunner {
    dev: Cuda,
    decoder: Decoder<Cuda>,
    /// Per layer: K and V caches, `[num_blocks of its KV cache group * block_size, kv_size]` each.
    kv: Vec<CudaKvLayer>,
    block_size: usize,
    /// Reused by every step; `None` until the first.
    acts: Option<Activations<Cuda>>,
    graphs: DecodeGraphs,
    /// The index buffers of steps that run eagerly, reused from step to step.
    eager_buffers: Option<StepBuffers>,
    /// Sampling and logprobs on the logits, with its buffers.
    sampler: GpuSampler,
    /// The `(t, row)` pairs of a step's previous tokens on their way to the device.
    previous: PreviousTokens,
    /// The last launched step's rows, while its sampling waits for its token masks (its
    /// logits stay in the activations until then: nothing else is launched meanwhile).
    awaiting_masks: Option<Vec<OwnedRowRequest>>,
}

/// The `(t, row)` pairs of a step's previous tokens (see [`ModelInput::previous_tokens`]), sent
/// to the device through a buffer kept from step to step.
#[derive(Default)]
struct PreviousTokens {
    staged: Option<StagedBuffer>,
}

impl PreviousTokens {
    /// Queues the writes of `input`'s previous tokens into the step's token ids on the device,
    /// from what the sampler's last launch sampled there.
    fn write(
        &mut self,
        gpu: &Gpu,
        sampler: &GpuSampler,
        vocab: usize,
        input: &ModelInput,
        buffers: &StepBuffers,
    ) -> Result<(), GpuError> {
        let pairs = &input.previous_tokens;
        if pairs.is_empty() {
            return Ok(());
        }
        let flat: Vec<u32> = pairs.iter().flat_map(|&(t, row)| [t, row]).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&flat);
        if self.staged.as_ref().is_none_or(|b| b.capacity() < bytes.len()) {
            self.staged = None;
            self.staged = Some(StagedBuffer::new(gpu, bytes.len().next_power_of_two())?);
        }
        let staged = self.staged.as_mut().expect("allocated above");
        let part = staged.write(gpu, &[bytes])?[0];
        sampler.write_sampled_tokens(gpu, pairs, &staged.view::<u32>(part), vocab, &buffers.token_ids())
    }
}

impl CudaRunner {
    /// Places `config`'s weights, read from `src`, on `gpu` in `dtype` (f32, bf16 or f16). The
    /// KV cache comes later, from [`ModelRunner::allocate_kv_cache`], once its size is known.
    /// Decode steps replay CUDA graphs unless [`Self::set_cuda_graphs`] turns them off.
    pub fn load(gpu: Gpu, dtype: DType, config: ModelConfig, src: &WeightSource) -> Result<CudaRunner, ModelError> {
        let dev = Cuda::new(gpu, dtype)?;
        let decoder = Decoder::load(&dev, config, src)?;
        dev.gpu().synchronize()?;
        Ok(CudaRunner {
            dev,
            decoder,
            kv: Vec::new(),
            block_size: 0,
            acts: None,
            graphs: DecodeGraphs::new(true),
            eager_buffers: None,
            sampler: GpuSampler::new(),
            previous: PreviousTokens::default(),
            awaiting_masks: None,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        self.dev.gpu()
    }

    /// Times cuBLAS against cuBLASLt's algorithms on the GEMMs of this runner's decode steps, so
    /// that each takes the faster (`Gemms::tune`): the projections and the LM head at each
    /// decode graph batch from 128 rows up to the one holding `max_decode_batch`. The first layer
    /// stands for all: every layer has the same shapes. Other shapes (prompt chunks among them:
    /// at 8192 rows tuning gained 0.4 %) keep `cublasGemmEx`. FP8 projections' GEMMs take the
    /// fastest of cuBLASLt's FP8 algorithms at the same batches (other shapes its preferred one).
    pub fn tune_gemms(&self, max_decode_batch: usize) -> Result<(), ModelError> {
        let Some(layer) = self.decoder.first_layer() else { return Ok(()) };
        // A bias is added to an f32 product (see `linear`).
        let output = |l: &Linear<Cuda>| if l.bias.is_some() { DType::F32 } else { self.dtype() };
        let mut weights = Vec::new();
        let mut fp8_weights = Vec::new();
        for l in layer.projections() {
            match &l.weight {
                CudaMatrix::Dense(w) => weights.push((w.view(), l.out_features, output(l))),
                CudaMatrix::Fp8(w) => fp8_weights.push((w.view(), l.out_features, output(l))),
            }
        }
        // The head computes only its first `output_vocab_size` rows (`Device::linear_prefix`).
        let (head, vocab) = (self.decoder.lm_head(), self.decoder.config.output_vocab_size);
        match &head.weight {
            CudaMatrix::Dense(w) => weights.push((w.slice(0..vocab * head.in_features), vocab, DType::F32)),
            CudaMatrix::Fp8(w) => fp8_weights.push((w.view(), vocab, DType::F32)),
        }
        let started = std::time::Instant::now();
        // Decode batches from 128 rows on, where the GEMMs approach their compute bound: tuning
        // times each on one copy of the weights, which the L2 may hold, and below that the
        // weights' reads dominate.
        let largest = graph_batch(max_decode_batch).unwrap_or(GRAPH_BATCHES[GRAPH_BATCHES.len() - 1]);
        let ms: Vec<usize> = GRAPH_BATCHES.iter().copied().filter(|&m| (128..=largest).contains(&m)).collect();
        if ms.is_empty() {
            return Ok(());
        }
        let report = self.dev.tune_gemms(&ms, &weights)?;
        let fp8_report = self.dev.tune_fp8_gemms(&ms, &fp8_weights)?;
        for t in &report {
            tracing::debug!(
                m = t.shape.m,
                n = t.shape.n,
                k = t.shape.k,
                cublas_us = t.default_us,
                cublaslt_us = t.best_us,
                candidates = t.candidates,
                taken = t.taken,
                "GEMM tuned"
            );
        }
        let taken = report.iter().filter(|t| t.taken).count();
        // One layer's GEMMs and the head at the largest decode batch, before and after: what a
        // decode step of that batch gains per layer.
        let (before, after) = report.iter().filter(|t| t.shape.m == largest).fold((0.0, 0.0), |(before, after), t| {
            let tuned = if t.taken { t.best_us.unwrap_or(t.default_us) } else { t.default_us };
            (before + t.default_us, after + tuned)
        });
        for t in &fp8_report {
            let Fp8GemmShape { m, n, k, .. } = t.shape;
            let (heuristic_us, best_us, candidates, fast) =
                (t.heuristic_us, t.best_us, t.candidates, t.fast_accumulation);
            tracing::debug!(m, n, k, heuristic_us, best_us, candidates, fast, "FP8 GEMM tuned");
        }
        let (fp8_before, fp8_after) = fp8_report
            .iter()
            .filter(|t| t.shape.m == largest)
            .fold((0.0, 0.0), |(before, after), t| (before + t.heuristic_us.unwrap_or(t.best_us), after + t.best_us));
        tracing::info!(
            shapes = report.len(),
            taken,
            fp8_shapes = fp8_report.len(),
            seconds = started.elapsed().as_secs_f64(),
            rows = largest,
            us_before = before + fp8_before,
            us_after = after + fp8_after,
            "decode GEMMs tuned: cuBLASLt algorithms kept where faster than cuBLAS's default (FP8: the fastest)"
        );
        Ok(())
    }

    pub fn dtype(&self) -> DType {
        self.dev.compute_dtype()
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.decoder.weight_bytes()
    }

    /// Device bytes of one KV block of `block_size` tokens over the layers of each KV cache
    /// group ([`ModelConfig::kv_cache_groups`]).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> Vec<usize> {
        let config = &self.decoder.config;
        config.kv_cache_groups().iter().map(|g| g.kv_bytes_per_block(config, block_size, self.dtype())).collect()
    }

    /// Device bytes of the activations of a step of `tokens` tokens and `rows` logits rows.
    pub fn activation_bytes(&self, tokens: usize, rows: usize) -> usize {
        Activations::bytes(&self.dev, &self.decoder.config, tokens, rows)
    }

    /// Turns CUDA graphs for decode steps off (or back on).
    pub fn set_cuda_graphs(&mut self, enabled: bool) {
        self.graphs.clear();
        self.graphs.disabled = !enabled;
    }

    /// Runs the decoder over `input`; the f32 logits of its `logits_indices` rows are then the
    /// first rows of `self.acts`' `logits` (see [`Self::logits`]). A batch of decodes replays a
    /// captured graph; anything else runs eagerly.
    fn forward(&mut self, input: &ModelInput) -> Result<(), GpuError> {
        let rows = input.logits_indices.len();
        let no_graph = self.graphs.disabled || self.decoder.config.num_hidden_layers == 0;
        let Some(shape) = (if no_graph { None } else { GraphShape::of(input) }) else {
            self.ensure_activations(input.num_tokens(), rows)?;
            StepBuffers::upload_reusing(&mut self.eager_buffers, self.dev.gpu(), input)?;
            let buffers = self.eager_buffers.as_ref().expect("buffers were just written");
            let vocab = self.decoder.config.output_vocab_size;
            self.previous.write(self.dev.gpu(), &self.sampler, vocab, input, buffers)?;
            let step = StepShape::of(input);
            let work = AttentionWork::default();
            let batches = buffers.batches(&step, self.block_size, &work);
            let acts = self.acts.as_mut().expect("activations were just ensured");
            return self.decoder.run(&self.dev, &batches, step.rows, &mut self.kv, acts);
        };
        let padded = shape.pad(input);
        self.ensure_activations(shape.batch, shape.batch)?;
        let vocab = self.decoder.config.output_vocab_size;
        if let Some(entry) = self.graphs.graphs.get_mut(&shape) {
            entry.buffers.copy_from(self.dev.gpu(), &padded)?;
            self.previous.write(self.dev.gpu(), &self.sampler, vocab, input, &entry.buffers)?;
            return entry.graph.launch();
        }
        // Only a capture needs the step's host-side shape; a replay has it baked in.
        let step = StepShape::of(&padded);
        let buffers = StepBuffers::upload(self.dev.gpu(), &padded)?;
        self.previous.write(self.dev.gpu(), &self.sampler, vocab, input, &buffers)?;
        let acts = self.acts.as_mut().expect("activations were just ensured");
        let (dev, decoder, kv) = (&self.dev, &self.decoder, &mut self.kv);
        let work = AttentionWork::default();
        let batches = buffers.batches(&step, self.block_size, &work);
        match dev.gpu().capture(|| decoder.run(dev, &batches, step.rows, kv, acts)) {
            Ok(graph) => {
                graph.launch()?;
                self.graphs.graphs.insert(shape, DecodeGraph { buffers, graph });
                Ok(())
            }
            Err(err) => {
                tracing::warn!("CUDA graph capture failed ({err}); decode steps run without graphs");
                self.graphs.clear();
                self.graphs.disabled = true;
                decoder.run(dev, &batches, step.rows, kv, acts)
            }
        }
    }

    /// Grows the activation buffers for a step of `tokens` tokens and `rows` logits rows;
    /// captured graphs go when the buffers move.
    fn ensure_activations(&mut self, tokens: usize, rows: usize) -> Result<(), GpuError> {
        if Activations::ensure(&mut self.acts, &self.dev, &self.decoder.config, tokens, rows)? {
            self.graphs.clear();
        }
        Ok(())
    }

    /// Queues the sampling of the last forward's logits rows.
    fn launch_sampler(&mut self, rows: &[RowRequest<'_>], masks: &TokenMasks) -> Result<(), GpuError> {
        // Taken out for the call so that the logits can stay borrowed from `self`.
        let mut sampler = std::mem::take(&mut self.sampler);
        let vocab = self.decoder.config.output_vocab_size;
        let launched = sampler.launch(self.gpu(), self.logits(rows.len()), vocab, rows, masks);
        self.sampler = sampler;
        launched
    }

    /// `[rows, output_vocab_size]` f32: the logits the last [`Self::forward`] computed.
    fn logits(&self, rows: usize) -> GpuView<'_> {
        let acts = self.acts.as_ref().expect("forward ran");
        acts.logits.first_rows(rows)
    }
}

impl ModelRunner for CudaRunner {
    fn config(&self) -> &ModelConfig {
        &self.decoder.config
    }

    fn device(&self) -> String {
        format!("cuda:0 ({})", self.gpu().name())
    }

    fn allocate_kv_cache(&mut self, num_blocks: &[usize], block_size: usize) -> Result<(), ModelError> {
        check_kv_groups(&self.decoder.config, num_blocks)?;
        // Free the old cache first so that its memory can be reused; graphs that wrote it go too.
        self.graphs.clear();
        self.kv.clear();
        self.kv = self.decoder.kv_cache(&self.dev, num_blocks, block_size)?;
        self.block_size = block_size;
        self.gpu().synchronize()?;
        Ok(())
    }

    fn limit_output_vocab(&mut self, num_ids: usize) {
        // The logits buffer (and the graphs that write it) follow the new width at the next
        // step: `Activations::ensure` reallocates it.
        self.decoder.config.limit_output_vocab(num_ids);
    }

    fn launch(&mut self, input: &ModelInput, rows: &[RowRequest<'_>]) -> Result<(), ModelError> {
        let num_rows = input.logits_indices.len();
        assert_eq!(rows.len(), num_rows, "launch: {} requests for {num_rows} logits rows", rows.len());
        assert!(self.awaiting_masks.is_none(), "launch: the step before still waits for its token masks");
        if self.kv.is_empty() && self.decoder.config.num_hidden_layers > 0 {
            return Err(ModelError::NoKvCache);
        }
        if input.num_tokens() > 0 {
            self.forward(input)?;
        }
        if rows.iter().any(RowRequest::is_masked) {
            self.awaiting_masks = Some(rows.iter().map(OwnedRowRequest::of).collect());
            return Ok(());
        }
        Ok(self.launch_sampler(rows, &TokenMasks::default())?)
    }

    fn set_token_masks(&mut self, masks: &TokenMasks) -> Result<(), ModelError> {
        let owned = self.awaiting_masks.take().ok_or(ModelError::NothingLaunched)?;
        let rows: Vec<RowRequest<'_>> = owned.iter().map(OwnedRowRequest::borrow).collect();
        Ok(self.launch_sampler(&rows, masks)?)
    }

    fn collect(&mut self) -> Result<Vec<Option<TokenLogprobs>>, ModelError> {
        // NOTE: a step waiting for its masks has not launched its sampler: the oldest is another's.
        Ok(self.sampler.collect()?)
    }
}
