/*
 * container_stub: a SPANK plugin that stands in for pyxis/enroot on a test cluster.
 *
 * Accepts pyxis' srun options so container-mode NeMo-Run scripts run unchanged:
 *   --container-image    ignored (no images here: the task runs on the host)
 *   --container-mounts   SRC:DST[:ro][,...] bind-mounted in a private mount namespace
 *   --container-workdir  DIR, the task's working directory
 *   --container-env      ignored (the environment is passed through anyway)
 * Build: gcc -shared -fPIC -o container_stub.so spank_container.c (libslurm-dev's slurm/spank.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>
#include <slurm/spank.h>

SPANK_PLUGIN(container_stub, 1);

static char *mounts, *workdir;

static int keep(int val, const char *arg, int remote)
{
    char **dst = val == 1 ? &mounts : val == 2 ? &workdir : NULL;
    if (dst) { free(*dst); *dst = strdup(arg ? arg : ""); }
    return 0;
}

struct spank_option spank_options[] = {
    {"container-image", "IMAGE", "container image (ignored by this stub)", 1, 0, keep},
    {"container-mounts", "SRC:DST[:ro],...", "bind mounts in a private mount namespace", 1, 1, keep},
    {"container-workdir", "DIR", "working directory of the task", 1, 2, keep},
    {"container-env", "NAMES", "environment to pass (ignored: all is passed)", 1, 0, keep},
    SPANK_OPTIONS_TABLE_END
};

static int bind_one(char *spec)
{
    char *src = strtok(spec, ":"), *dst = strtok(NULL, ":"), *flags = strtok(NULL, ":");
    if (!src || !dst) { slurm_error("container_stub: bad mount '%s'", spec); return -1; }
    mkdir(dst, 0755);  /* the target may exist; a missing parent makes mount() fail below */
    if (mount(src, dst, NULL, MS_BIND | MS_REC, NULL) < 0
        || (flags && !strcmp(flags, "ro")
            && mount(NULL, dst, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) < 0)) {
        slurm_error("container_stub: mount %s -> %s: %s", src, dst, strerror(errno));
        return -1;
    }
    return 0;
}

/* Before privileges are dropped: a private mount namespace per task, then the binds. */
int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
    if (!mounts || !*mounts) return 0;
    if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
        slurm_error("container_stub: private mount namespace: %s", strerror(errno));
        return -1;
    }
    char *list = strdup(mounts), *save = NULL;
    int rc = 0;
    for (char *m = strtok_r(list, ",", &save); m && !rc; m = strtok_r(NULL, ",", &save))
        rc = bind_one(m);
    free(list);
    return rc;
}

/* After slurmstepd's own chdir, so this one wins. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    if (workdir && *workdir && chdir(workdir) < 0) {
        slurm_error("container_stub: chdir %s: %s", workdir, strerror(errno));
        return -1;
    }
    return 0;
}
