//! The METG plot: efficiency against time per task for each system, as Task Bench draws it
//! (log time axis, the 50% line), written as a PNG with plotters. Labels use the bundled DejaVu
//! Sans Mono (`assets/`, Bitstream Vera license), so no system font is needed.

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

/// One system's curve: name, `(time per task µs, efficiency)` points, its METG.
pub struct Curve<'a> {
    pub name: &'a str,
    pub points: &'a [(f64, f64)],
    pub metg: Option<f64>,
}

/// Draws `curves` into `path` (PNG, 900×600).
pub fn metg_png(path: &Path, title: &str, curves: &[Curve<'_>]) -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow!("the bundled font does not load"))?;
    let all: Vec<f64> = curves
        .iter()
        .flat_map(|c| c.points.iter().map(|p| p.0))
        .filter(|t| *t > 0.0)
        .collect();
    let (lo, hi) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), &t| (a.min(t), b.max(t)));
    if all.is_empty() {
        return Err(anyhow!("nothing to plot"));
    }
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((lo / 1.5..hi * 1.5).log_scale(), 0.0..1.1)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("time per task (µs, log scale)")
        .y_desc("efficiency")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .draw_series(LineSeries::new([(lo / 1.5, 0.5), (hi * 1.5, 0.5)], BLACK.mix(0.4)))
        .map_err(|e| anyhow!("{e}"))?;
    let colors = [RED, BLUE, GREEN, MAGENTA];
    for (k, c) in curves.iter().enumerate() {
        let color = colors[k % colors.len()];
        let mut pts: Vec<(f64, f64)> = c.points.iter().copied().filter(|p| p.0 > 0.0).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let label = match c.metg {
            Some(m) => format!("{} (METG {m:.2} µs)", c.name),
            None => format!("{} (METG not reached)", c.name),
        };
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| anyhow!("{e}"))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
