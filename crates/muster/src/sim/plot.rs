//! Plots as SVG text (plotters' SVG backend writes text as `<text>`, so no
//! font files are needed and the same results give the same bytes).

use super::replay::ReplayReport;
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

/// The distribution of job completion times, one line per policy, on a
/// logarithmic axis in hours.
pub fn jct_cdf_svg(report: &ReplayReport) -> anyhow::Result<String> {
    const FLOOR_H: f64 = 1.0 / 60.0;
    let hours = |seconds: f64| (seconds / 3600.0).max(FLOOR_H);
    let largest = report
        .results
        .iter()
        .flat_map(|result| result.jct_cdf.iter().map(|&(jct, _)| hours(jct)))
        .fold(FLOOR_H * 10.0, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "Job completion time: {} on {} GPUs",
                    report.trace, report.cluster.gpus
                ),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d((FLOOR_H..largest * 1.5).log_scale(), 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("job completion time (hours, log scale; below 1 minute drawn at 1 minute)")
            .y_desc("fraction of completed jobs")
            .x_label_formatter(&|hours| format_hours(*hours))
            .y_label_formatter(&|fraction| format!("{fraction:.1}"))
            .draw()?;
        for (index, result) in report.results.iter().enumerate() {
            let color = COLORS[index % COLORS.len()];
            let points = std::iter::once((FLOOR_H, 0.0)).chain(
                result
                    .jct_cdf
                    .iter()
                    .map(|&(jct, fraction)| (hours(jct), fraction)),
            );
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(format!(
                    "{}: mean {:.1} h, p50 {:.1} h, p99 {:.0} h",
                    super::replay::label(result),
                    result.mean_jct_s / 3600.0,
                    result.p50_jct_s / 3600.0,
                    result.p99_jct_s / 3600.0
                ))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

fn format_hours(hours: f64) -> String {
    if hours >= 1.0 {
        format!("{hours:.0}")
    } else if hours >= 0.1 {
        format!("{hours:.1}")
    } else {
        format!("{hours:.2}")
    }
}

/// Busy GPUs over time, one line per policy, with the capacity.
pub fn utilization_svg(report: &ReplayReport) -> anyhow::Result<String> {
    let capacity = report.cluster.gpus as f64;
    timeline_svg(
        report,
        "Busy GPUs",
        "busy GPUs",
        capacity.max(1.0) * 1.05,
        Some(capacity),
        SeriesLabelPosition::LowerRight,
        |&(_, busy, _)| busy,
    )
}

/// Pending jobs over time, one line per policy.
pub fn queue_length_svg(report: &ReplayReport) -> anyhow::Result<String> {
    let largest = report
        .results
        .iter()
        .flat_map(|result| {
            result
                .timeline
                .iter()
                .map(|&(_, _, pending)| pending as f64)
        })
        .fold(1.0, f64::max);
    timeline_svg(
        report,
        "Pending jobs",
        "pending jobs",
        largest * 1.05,
        None,
        SeriesLabelPosition::UpperRight,
        |&(_, _, pending)| pending as f64,
    )
}

fn timeline_svg(
    report: &ReplayReport,
    title: &str,
    y_desc: &str,
    y_max: f64,
    capacity: Option<f64>,
    legend: SeriesLabelPosition,
    value: impl Fn(&(f64, f64, usize)) -> f64,
) -> anyhow::Result<String> {
    const DAY: f64 = 86_400.0;
    let days = report
        .results
        .iter()
        .flat_map(|result| result.timeline.iter().map(|&(t, _, _)| t / DAY))
        .fold(0.1, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{title}: {} on {} GPUs", report.trace, report.cluster.gpus),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..days, 0f64..y_max)?;
        chart
            .configure_mesh()
            .x_desc("days since the first submission (sampled every few scheduling cycles)")
            .y_desc(y_desc)
            .x_label_formatter(&|day| format!("{day:.0}"))
            .y_label_formatter(&|count| format!("{count:.0}"))
            .draw()?;
        if let Some(capacity) = capacity {
            let bound = RGBColor(160, 160, 160);
            chart
                .draw_series(LineSeries::new(
                    [(0.0, capacity), (days, capacity)],
                    bound.stroke_width(1),
                ))?
                .label(format!("capacity ({capacity:.0} GPUs)"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], bound));
        }
        for (index, result) in report.results.iter().enumerate() {
            let color = COLORS[index % COLORS.len()];
            let points = result
                .timeline
                .iter()
                .map(|point| (point.0 / DAY, value(point)));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(1)))?
                .label(super::replay::label(result))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}
