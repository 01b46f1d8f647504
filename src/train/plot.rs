//! The loss curve as a PNG, drawn with `plotters`: a titled chart of the train loss (a line) and
//! the held-out loss (large dots joined by a faint line) by step, with labelled
//! axes, rounded ticks, a grid and a legend; below it, when the run evaluated, the held-out
//! exact-match accuracy in percent. Text is drawn with DejaVu Sans, embedded in the binary
//! (`assets/fonts/DejaVuSans.ttf`, Bitstream Vera licence: redistribution allowed, the notice is
//! in `assets/fonts/LICENSE-DejaVu.txt`) through plotters' `ab_glyph` renderer, so no system
//! fonts or fontconfig are needed. The pixels are encoded with `png` and written atomically.

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;

const W: u32 = 900;
const H: u32 = 600;
/// The name the embedded font is registered under.
const FONT: &str = "xtrain-sans";

static DEJAVU_SANS: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

const TRAIN: RGBColor = RGBColor(31, 119, 180);
const EVAL: RGBColor = RGBColor(214, 39, 40);
const ACCURACY: RGBColor = RGBColor(44, 160, 44);

fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = ONCE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, DEJAVU_SANS).is_ok()
    });
    anyhow::ensure!(*ok, "the embedded font cannot be read");
    Ok(())
}

/// (low, high) of `values` with a margin, or (0, 1) when there are none.
fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    if lo > hi {
        (0.0, 1.0)
    } else if lo == hi {
        (lo - 0.5, hi + 0.5)
    } else {
        let pad = (hi - lo) * 0.05;
        (lo - pad, hi + pad)
    }
}

/// Plot the train loss (`(step, loss or NaN, eval loss)` points, as [`crate::train::log::Metrics`]
/// keeps them) and the held-out accuracy (`(step, fraction)`) into a PNG at `path` (written
/// atomically), under `title`.
pub fn loss_curve(
    path: &Path,
    points: &[(u64, f64, Option<f64>)],
    accuracy: &[(u64, f64)],
    title: &str,
) -> Result<()> {
    register_font()?;
    let mut pixels = vec![255u8; (W * H * 3) as usize];
    draw(&mut pixels, points, accuracy, title)
        .map_err(|e| anyhow::anyhow!("drawing the loss curve: {e}"))?;
    let mut bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut bytes, W, H);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().context("png header")?;
        w.write_image_data(&pixels).context("png data")?;
    }
    crate::formats::atomic::write_bytes_atomic(path, &bytes)
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn draw(
    pixels: &mut [u8],
    points: &[(u64, f64, Option<f64>)],
    accuracy: &[(u64, f64)],
    title: &str,
) -> DrawResult {
    let train: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.1.is_finite())
        .map(|p| (p.0 as f64, p.1))
        .collect();
    let eval: Vec<(f64, f64)> = points
        .iter()
        .filter_map(|p| p.2.filter(|e| e.is_finite()).map(|e| (p.0 as f64, e)))
        .collect();
    let accuracy: Vec<(f64, f64)> = accuracy
        .iter()
        .filter(|a| a.1.is_finite())
        .map(|&(s, a)| (s as f64, 100.0 * a))
        .collect();
    let max_step = points
        .iter()
        .map(|p| p.0)
        .chain(accuracy.iter().map(|a| a.0 as u64))
        .max()
        .unwrap_or(1)
        .max(1) as f64;

    let root = BitMapBackend::with_buffer(pixels, (W, H)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, (FONT, 24).into_font())?;
    let (top, bottom) = if accuracy.is_empty() {
        (root.clone(), None)
    } else {
        let (t, b) = root.split_vertically(H as i32 * 62 / 100);
        (t, Some(b))
    };

    let (lo, hi) = range(train.iter().chain(&eval).map(|p| p.1));
    let mut chart = ChartBuilder::on(&top)
        .margin(12)
        .x_label_area_size(if bottom.is_some() { 30 } else { 46 })
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_step, lo..hi)?;
    let mut mesh = chart.configure_mesh();
    mesh.y_desc("loss (cross-entropy per token)")
        .y_label_formatter(&|v| format!("{v:.2}"))
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .light_line_style(RGBColor(235, 235, 235));
    if bottom.is_none() {
        mesh.x_desc("step");
    }
    mesh.draw()?;
    if !train.is_empty() {
        chart
            .draw_series(LineSeries::new(
                train.iter().copied(),
                TRAIN.stroke_width(2),
            ))?
            .label("train loss")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], TRAIN.stroke_width(3)));
    }
    if !eval.is_empty() {
        chart.draw_series(LineSeries::new(eval.iter().copied(), EVAL.mix(0.5)))?;
        chart
            .draw_series(
                eval.iter()
                    .map(|&(s, v)| Circle::new((s, v), 6, EVAL.filled())),
            )?
            .label("held-out loss")
            .legend(|(x, y)| Circle::new((x + 12, y), 6, EVAL.filled()));
    }
    if !train.is_empty() || !eval.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .draw()?;
    }

    if let Some(bottom) = bottom {
        draw_accuracy(&bottom, &accuracy, max_step)?;
    }
    root.present()?;
    Ok(())
}

/// The lower panel: held-out exact-match accuracy (%) against the step.
fn draw_accuracy(
    bottom: &DrawingArea<BitMapBackend<'_>, Shift>,
    accuracy: &[(f64, f64)],
    max_step: f64,
) -> DrawResult {
    let mut chart = ChartBuilder::on(bottom)
        .margin(12)
        .x_label_area_size(46)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_step, 0f64..100f64)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("exact match (%)")
        .y_labels(6)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    chart.draw_series(LineSeries::new(
        accuracy.iter().copied(),
        ACCURACY.stroke_width(2),
    ))?;
    chart
        .draw_series(
            accuracy
                .iter()
                .map(|&(s, a)| Circle::new((s, a), 6, ACCURACY.filled())),
        )?
        .label("held-out exact-match accuracy")
        .legend(|(x, y)| Circle::new((x + 12, y), 6, ACCURACY.filled()));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A curve with and without evaluations is drawn into a PNG of the expected size.
    #[test]
    fn draws_a_png() {
        let dir = std::env::temp_dir().join(format!("xtrain-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let points: Vec<(u64, f64, Option<f64>)> = (1..=20)
            .map(|s| (s, 2.0 / s as f64, None))
            .chain([(0, f64::NAN, Some(2.1)), (20, f64::NAN, Some(0.4))])
            .collect();
        for (name, acc) in [("a.png", vec![(0, 0.0), (20, 0.66)]), ("b.png", vec![])] {
            let p = dir.join(name);
            loss_curve(&p, &points, &acc, "test run").unwrap();
            let d = png::Decoder::new(std::fs::File::open(&p).unwrap());
            let r = d.read_info().unwrap();
            assert_eq!((r.info().width, r.info().height), (W, H));
        }
        loss_curve(&dir.join("empty.png"), &[], &[], "nothing yet").unwrap();
        if std::env::var_os("XTRAIN_KEEP_PLOT").is_none() {
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
