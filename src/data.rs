//! Small data sets for examples and tests.

use crate::{Error, Result};
use std::io::Read;
use std::path::Path;

/// A labelled image data set held in memory.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// Pixels, `len × features`, scaled to [0, 1].
    pub x: Vec<f32>,
    /// Labels.
    pub y: Vec<i64>,
    /// Features per example.
    pub features: usize,
}

impl Dataset {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.y.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
    /// The examples at `idx`, in that order.
    pub fn select(&self, idx: &[usize]) -> Dataset {
        let f = self.features;
        let mut x = Vec::with_capacity(idx.len() * f);
        for &i in idx {
            x.extend_from_slice(&self.x[i * f..(i + 1) * f]);
        }
        Dataset {
            x,
            y: idx.iter().map(|&i| self.y[i]).collect(),
            features: f,
        }
    }
    /// A fixed, seeded split into (train, test) with `test` examples held out.
    pub fn split(&self, test: usize, seed: u64) -> (Dataset, Dataset) {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        // Fisher–Yates with the project's counter-based generator.
        for i in (1..idx.len()).rev() {
            let j = (rustytorch_ops::rng::uniform01(seed, i as u64) * (i + 1) as f64) as usize;
            idx.swap(i, j.min(i));
        }
        let (te, tr) = idx.split_at(test.min(idx.len()));
        (self.select(tr), self.select(te))
    }
}

/// Reads the UCI optical digits CSV (gzip): 64 pixels in 0..16 then the label, per row.
pub fn load_digits(path: &Path) -> Result<Dataset> {
    let err = |reason: String| Error::File {
        path: path.display().to_string(),
        reason,
    };
    let f = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(f)
        .read_to_string(&mut text)
        .map_err(|e| err(format!("not a gzip CSV: {e}")))?;
    let mut x = Vec::new();
    let mut y = Vec::new();
    for (ln, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let vals: Vec<&str> = line.split(',').collect();
        if vals.len() != 65 {
            return Err(err(format!(
                "line {}: {} fields, expected 65",
                ln + 1,
                vals.len()
            )));
        }
        for v in &vals[..64] {
            let p: f32 = v
                .trim()
                .parse()
                .map_err(|_| err(format!("line {}: bad pixel `{v}`", ln + 1)))?;
            x.push(p / 16.0);
        }
        let label: i64 = vals[64]
            .trim()
            .parse()
            .map_err(|_| err(format!("line {}: bad label", ln + 1)))?;
        y.push(label);
    }
    Ok(Dataset { x, y, features: 64 })
}
