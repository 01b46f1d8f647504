//! The loss curve as a PNG: train loss as a line, eval loss as dots, with a few tick labels
//! drawn in a tiny built-in bitmap font (no font files needed).

use anyhow::{Context, Result};
use std::path::Path;

const W: usize = 640;
const H: usize = 400;
const L: usize = 56;
const R: usize = 16;
const T: usize = 24;
const B: usize = 36;

struct Canvas {
    px: Vec<[u8; 3]>,
}

/// 3x5 glyphs for digits and a few characters, one row per u8 (3 low bits).
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        'e' => [0, 7, 7, 4, 7],
        's' => [0, 7, 6, 1, 7],
        't' => [2, 7, 2, 2, 3],
        'p' => [0, 7, 5, 7, 4],
        'l' => [6, 2, 2, 2, 7],
        'o' => [0, 7, 5, 5, 7],
        'v' => [0, 5, 5, 5, 2],
        'a' => [0, 7, 1, 7, 7],
        'r' => [0, 7, 4, 4, 4],
        'i' => [2, 0, 2, 2, 2],
        'n' => [0, 7, 5, 5, 5],
        ' ' => [0; 5],
        _ => [7, 7, 7, 7, 7],
    }
}

impl Canvas {
    fn new() -> Canvas {
        Canvas {
            px: vec![[255, 255, 255]; W * H],
        }
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            self.px[y as usize * W + x as usize] = c;
        }
    }

    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: [u8; 3]) {
        let n = ((x1 - x0).abs().max((y1 - y0).abs()) as usize).max(1);
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = (x0 + (x1 - x0) * t, y0 + (y1 - y0) * t);
            self.set(x.round() as i64, y.round() as i64, c);
            self.set(x.round() as i64, y.round() as i64 + 1, c);
        }
    }

    fn text(&mut self, x: usize, y: usize, s: &str, c: [u8; 3]) {
        for (k, ch) in s.chars().enumerate() {
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..3 {
                    if bits & (4 >> col) != 0 {
                        for dy in 0..2 {
                            for dx in 0..2 {
                                self.set(
                                    (x + k * 8 + col * 2 + dx) as i64,
                                    (y + row * 2 + dy) as i64,
                                    c,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Plot `(step, train loss or NaN, eval loss)` points into a PNG at `path` (written atomically).
pub fn loss_curve(path: &Path, points: &[(u64, f64, Option<f64>)]) -> Result<()> {
    let mut c = Canvas::new();
    let train: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.1.is_finite())
        .map(|p| (p.0 as f64, p.1))
        .collect();
    let eval: Vec<(f64, f64)> = points
        .iter()
        .filter_map(|p| p.2.map(|e| (p.0 as f64, e)))
        .collect();
    let all: Vec<f64> = train.iter().chain(&eval).map(|p| p.1).collect();
    let (lo, hi) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo < hi {
        (lo, hi)
    } else {
        (lo - 1.0, lo + 1.0)
    };
    let max_step = points.iter().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let sx = |s: f64| L as f64 + s / max_step * (W - L - R) as f64;
    let sy = |v: f64| T as f64 + (hi - v) / (hi - lo) * (H - T - B) as f64;
    let axis = [90, 90, 90];
    c.line((L as f64, T as f64), (L as f64, (H - B) as f64), axis);
    c.line(
        (L as f64, (H - B) as f64),
        ((W - R) as f64, (H - B) as f64),
        axis,
    );
    for k in 0..=4 {
        let v = lo + (hi - lo) * k as f64 / 4.0;
        let y = sy(v);
        c.line((L as f64 - 4.0, y), (L as f64, y), axis);
        c.text(4, (y as usize).saturating_sub(5), &format!("{v:.2}"), axis);
        let s = max_step * k as f64 / 4.0;
        c.line((sx(s), (H - B) as f64), (sx(s), (H - B + 4) as f64), axis);
        c.text(
            (sx(s) as usize).saturating_sub(8),
            H - B + 8,
            &format!("{}", s.round() as u64),
            axis,
        );
    }
    c.text(W / 2 - 16, H - 12, "step", axis);
    c.text(L + 8, 6, "train loss", [31, 119, 180]);
    c.text(L + 110, 6, "eval loss", [214, 39, 40]);
    for w in train.windows(2) {
        c.line(
            (sx(w[0].0), sy(w[0].1)),
            (sx(w[1].0), sy(w[1].1)),
            [31, 119, 180],
        );
    }
    for &(s, v) in &eval {
        for dy in -3..=3i64 {
            for dx in -3..=3i64 {
                if dx * dx + dy * dy <= 9 {
                    c.set(sx(s) as i64 + dx, sy(v) as i64 + dy, [214, 39, 40]);
                }
            }
        }
    }
    let mut bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut bytes, W as u32, H as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().context("png header")?;
        let data: Vec<u8> = c.px.iter().flatten().copied().collect();
        w.write_image_data(&data).context("png data")?;
    }
    crate::formats::atomic::write_bytes_atomic(path, &bytes)
}
