//! Synthetic allocation traces shaped like real models, for measuring planners: the tensors a
//! transformer or a residual CNN allocates in a training step (forward, then backward in
//! reverse, activations saved for it) or in inference. Deterministic for a given seed.

use super::Allocation;

/// Builds a trace op by op: each op is one time step; tensors live from the op that makes
/// them to the last op that reads them.
struct Tracer {
    allocs: Vec<Allocation>,
    now: u64,
    rng: u64,
}

impl Tracer {
    fn new(seed: u64) -> Tracer {
        Tracer {
            allocs: Vec::new(),
            now: 0,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// splitmix64.
    fn random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// One op reading `inputs` and making tensors of `outputs` bytes; a cuBLAS/cuDNN-like
    /// workspace lives for the op alone, now and then.
    fn op(&mut self, inputs: &[usize], outputs: &[u64]) -> Vec<usize> {
        self.now += 1;
        for &i in inputs {
            self.allocs[i].last_use = self.now;
        }
        if self.random().is_multiple_of(4) {
            let workspace = (1 + self.random() % 64) << 16;
            self.tensor(workspace);
        }
        outputs.iter().map(|&s| self.tensor(s)).collect()
    }

    fn tensor(&mut self, size: u64) -> usize {
        self.allocs.push(Allocation::new(size, self.now, self.now));
        self.allocs.len() - 1
    }

    /// Keeps `ids` live until the current step.
    fn keep(&mut self, ids: &[usize]) {
        for &i in ids {
            self.allocs[i].last_use = self.now;
        }
    }
}

/// A transformer training step with gradient accumulation: `micro_batches` forward and
/// backward passes through `layers` layers, each micro-batch with its own sequence length
/// (`batch` × up to `seq` tokens, `hidden` wide, `heads` attention heads, fp16). Weight
/// gradients are made in the first backward pass and live to the end of the step.
pub fn transformer_training(
    layers: usize,
    micro_batches: usize,
    batch: u64,
    seq: u64,
    hidden: u64,
    heads: u64,
    seed: u64,
) -> Vec<Allocation> {
    let mut t = Tracer::new(seed);
    let mut grads: Vec<usize> = Vec::new();
    for mb in 0..micro_batches {
        // Sequence lengths vary by micro-batch (bucketed dynamic shapes), in steps of 64.
        let s = (seq / 2 + (t.random() % (seq / 2 / 64 + 1)) * 64).max(64);
        let bsh = batch * s * hidden * 2;
        let bhss = batch * heads * s * s * 2;
        let mut x = t.op(&[], &[bsh])[0];
        let mut saved = Vec::new();
        for _ in 0..layers {
            let ln1 = t.op(&[x], &[bsh])[0];
            let qkv = t.op(&[ln1], &[3 * bsh])[0];
            let scores = t.op(&[qkv], &[bhss])[0];
            let probs = t.op(&[scores], &[bhss])[0];
            let ctx = t.op(&[probs, qkv], &[bsh])[0];
            let proj = t.op(&[ctx], &[bsh])[0];
            let x1 = t.op(&[x, proj], &[bsh])[0];
            let ln2 = t.op(&[x1], &[bsh])[0];
            let up = t.op(&[ln2], &[4 * bsh])[0];
            let act = t.op(&[up], &[4 * bsh])[0];
            let down = t.op(&[act], &[bsh])[0];
            let x2 = t.op(&[x1, down], &[bsh])[0];
            saved.push([x, ln1, qkv, probs, ctx, x1, ln2, up, act]);
            x = x2;
        }
        let loss = t.op(&[x], &[bsh])[0];
        let mut g = t.op(&[loss], &[bsh])[0];
        let weight = |t: &mut Tracer, size: u64, grads: &mut Vec<usize>, first: bool| {
            if first {
                let w = t.tensor(size);
                grads.push(w);
            }
        };
        for [x, ln1, qkv, probs, ctx, x1, ln2, up, act] in saved.into_iter().rev() {
            let first = mb == 0;
            let g_down = t.op(&[g, act], &[4 * bsh])[0];
            weight(&mut t, 8 * hidden * hidden, &mut grads, first);
            let g_up = t.op(&[g_down, up], &[4 * bsh])[0];
            let g_ln2 = t.op(&[g_up, ln2], &[bsh])[0];
            weight(&mut t, 8 * hidden * hidden, &mut grads, first);
            let g_x1 = t.op(&[g_ln2, x1, g], &[bsh])[0];
            let g_ctx = t.op(&[g_x1, ctx], &[bsh])[0];
            weight(&mut t, 2 * hidden * hidden, &mut grads, first);
            let g_probs = t.op(&[g_ctx, probs, qkv], &[bhss])[0];
            let g_scores = t.op(&[g_probs, probs], &[bhss])[0];
            let g_qkv = t.op(&[g_scores, qkv], &[3 * bsh])[0];
            let g_ln1 = t.op(&[g_qkv, ln1], &[bsh])[0];
            weight(&mut t, 6 * hidden * hidden, &mut grads, first);
            g = t.op(&[g_ln1, x, g_x1], &[bsh])[0];
        }
        t.op(&[g], &[]);
    }
    t.op(&[], &[]);
    t.keep(&grads);
    t.allocs
}

/// A residual CNN (ResNet-50 layout: bottleneck blocks of 3, 4, 6, 3 in four stages) training
/// step on `batch` images of `image` × `image` pixels, fp32, repeated `steps` times.
pub fn cnn_training(batch: u64, image: u64, steps: usize, seed: u64) -> Vec<Allocation> {
    let mut t = Tracer::new(seed);
    let stages = [
        (3usize, 256u64, 4u64),
        (4, 512, 8),
        (6, 1024, 16),
        (3, 2048, 32),
    ];
    for _ in 0..steps {
        let bytes = |c: u64, side: u64| batch * c * side * side * 4;
        let side0 = image / 4;
        let mut x = t.op(&[], &[bytes(64, side0)])[0];
        let mut saved = Vec::new();
        for (blocks, channels, down) in stages {
            let side = (image / down).max(1);
            for _ in 0..blocks {
                let mid = channels / 4;
                let c1 = t.op(&[x], &[bytes(mid, side)])[0];
                let b1 = t.op(&[c1], &[bytes(mid, side)])[0];
                let r1 = t.op(&[b1], &[bytes(mid, side)])[0];
                let c2 = t.op(&[r1], &[bytes(mid, side)])[0];
                let b2 = t.op(&[c2], &[bytes(mid, side)])[0];
                let r2 = t.op(&[b2], &[bytes(mid, side)])[0];
                let c3 = t.op(&[r2], &[bytes(channels, side)])[0];
                let b3 = t.op(&[c3], &[bytes(channels, side)])[0];
                let sum = t.op(&[b3, x], &[bytes(channels, side)])[0];
                let out = t.op(&[sum], &[bytes(channels, side)])[0];
                saved.push((
                    [x, c1, b1, r1, c2, b2, r2, c3, b3, out],
                    channels,
                    mid,
                    side,
                ));
                x = out;
            }
        }
        let mut g = t.op(&[x], &[bytes(2048, (image / 32).max(1))])[0];
        for ([x, c1, b1, r1, c2, b2, r2, c3, b3, out], channels, mid, side) in
            saved.into_iter().rev()
        {
            let g_sum = t.op(&[g, out], &[bytes(channels, side)])[0];
            let g_c3 = t.op(&[g_sum, b3, c3], &[bytes(channels, side)])[0];
            let g_r2 = t.op(&[g_c3, r2], &[bytes(mid, side)])[0];
            let g_c2 = t.op(&[g_r2, b2, c2], &[bytes(mid, side)])[0];
            let g_r1 = t.op(&[g_c2, r1], &[bytes(mid, side)])[0];
            let g_c1 = t.op(&[g_r1, b1, c1], &[bytes(mid, side)])[0];
            let g_x = t.op(&[g_c1, x], &[bytes(channels, side)])[0];
            g = t.op(&[g_x, g_sum], &[bytes(channels, side)])[0];
        }
        t.op(&[g], &[]);
    }
    t.allocs
}

/// Transformer inference: `requests` forward passes of `layers` layers, each with its own
/// sequence length (up to `seq`), fp16.
pub fn transformer_inference(
    layers: usize,
    requests: usize,
    batch: u64,
    seq: u64,
    hidden: u64,
    heads: u64,
    seed: u64,
) -> Vec<Allocation> {
    let mut t = Tracer::new(seed);
    for _ in 0..requests {
        let s = (1 + t.random() % (seq / 64).max(1)) * 64;
        let bsh = batch * s * hidden * 2;
        let bhss = batch * heads * s * s * 2;
        let mut x = t.op(&[], &[bsh])[0];
        for _ in 0..layers {
            let ln1 = t.op(&[x], &[bsh])[0];
            let qkv = t.op(&[ln1], &[3 * bsh])[0];
            let probs = t.op(&[qkv], &[bhss])[0];
            let ctx = t.op(&[probs, qkv], &[bsh])[0];
            let x1 = t.op(&[x, ctx], &[bsh])[0];
            let up = t.op(&[x1], &[4 * bsh])[0];
            let down = t.op(&[up], &[bsh])[0];
            x = t.op(&[x1, down], &[bsh])[0];
        }
        t.op(&[x], &[]);
    }
    t.allocs
}

/// A dense graph of `n` nodes with sizes of every magnitude, shaped like the
/// intra-operator-parallelism graphs of sharded models (one tensor per node, made at its
/// node's step): 15% of the tensors live almost throughout (parameters and their shards), a
/// fifth up to a quarter of the steps, the rest up to 30 steps; sizes are 4^k × (1 to 1,000)
/// bytes for k below 10, 1 byte to 262 MB. Thousands of tensors are live at every step, and a
/// layout of them has thousands of free gaps.
pub fn sharded_graph(n: usize, seed: u64) -> Vec<Allocation> {
    let mut t = Tracer::new(seed);
    let n = n as u64;
    // Long-lived tensors start within the first twentieth of the steps and end within the last.
    let edge = (n / 20).max(1);
    (0..n)
        .map(|i| {
            let (first, last) = match t.random() % 20 {
                0..=2 => (t.random() % edge, n - 1 - t.random() % edge),
                3..=6 => (i, (i + 1 + t.random() % (n / 4).max(1)).min(n - 1)),
                _ => (i, (i + 1 + t.random() % 30).min(n - 1)),
            };
            let size = (1u64 << (2 * (t.random() % 10))) * (1 + t.random() % 1000);
            Allocation::new(size, first, last.max(first))
        })
        .collect()
}

/// Reads a planning instance in MiniMalloc's CSV format (a header line, then `id,lower,upper,
/// size` rows with half-open lifetimes `[lower, upper)`) as allocations with inclusive last
/// uses `upper - 1`. Fails, naming the line, on a row that is not four integers or whose
/// lifetime is empty.
pub fn minimalloc_csv(text: &str) -> crate::error::Result<Vec<Allocation>> {
    use crate::error::Error;
    text.lines()
        .enumerate()
        .skip(1)
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(k, line)| {
            let bad = |why: &str| Error::InvalidArgument(format!("line {}: {why}: {line}", k + 1));
            let v: Vec<u64> = line
                .split(',')
                .map(|x| x.trim().parse())
                .collect::<Result<_, _>>()
                .map_err(|_| bad("not four unsigned integers"))?;
            let [_, lower, upper, size] = v[..] else {
                return Err(bad("not four unsigned integers"));
            };
            if upper <= lower {
                return Err(bad("empty lifetime"));
            }
            Ok(Allocation::new(size, lower, upper - 1))
        })
        .collect()
}
