/* `detproxy diagnose` (SPEC §11). */
#include <stdio.h>

#include "proxy/cli.h"

int px_cmd_diagnose(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "detproxy diagnose: not built yet\n");
    return 3;
}
