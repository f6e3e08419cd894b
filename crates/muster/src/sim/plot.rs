//! Plots as SVG text (plotters' SVG backend writes text as `<text>`, so no
//! font files are needed and the same results give the same bytes).

use muster_sim::{AllocationReport, MAX_LOAD_PCT};
use plotters::prelude::*;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// GPU allocation ratio against arrived load, one line per policy.
pub fn allocation_svg(report: &AllocationReport) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let max_load = MAX_LOAD_PCT as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "GPU allocation under load: {} on {} GPUs",
                    report.tasks_file, report.gpus
                ),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..max_load, 0f64..100f64)?;
        chart
            .configure_mesh()
            .x_desc("arrived GPU request (% of capacity)")
            .y_desc("GPU allocation ratio (%)")
            .x_label_formatter(&|load| format!("{load:.0}"))
            .y_label_formatter(&|ratio| format!("{ratio:.0}"))
            .draw()?;
        let bound = RGBColor(160, 160, 160);
        chart
            .draw_series(LineSeries::new(
                [(0.0, 0.0), (100.0, 100.0), (max_load, 100.0)],
                bound.stroke_width(1),
            ))?
            .label("arrived (upper bound)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], bound));
        for (index, result) in report.policies.iter().enumerate() {
            let color = COLORS[index % COLORS.len()];
            let points = result
                .alloc_ratio_pct
                .iter()
                .enumerate()
                .map(|(load, &ratio)| (load as f64, ratio));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(format!(
                    "{}: {:.1}% at 100%, {:.1}% at 130%",
                    result.policy, result.alloc_ratio_at_100, result.alloc_ratio_at_130
                ))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}
